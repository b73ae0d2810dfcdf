from kvboost_rag.bench.warm.run import main

main()
