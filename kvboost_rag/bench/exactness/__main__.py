from kvboost_rag.bench.exactness.run import main

main()
