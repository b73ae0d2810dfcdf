from kvboost_rag.bench.suite.run import main

main()
