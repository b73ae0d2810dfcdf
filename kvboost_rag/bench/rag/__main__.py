from kvboost_rag.bench.rag.run import main

main()
