from kvboost_rag.bench.load.run import main

main()
