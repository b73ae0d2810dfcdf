from kvboost_rag.bench.remote.run import main

main()
