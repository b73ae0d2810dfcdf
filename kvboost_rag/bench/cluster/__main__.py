from kvboost_rag.bench.cluster.run import main

main()
