from kvboost_rag.bench.tools.run import main

main()
