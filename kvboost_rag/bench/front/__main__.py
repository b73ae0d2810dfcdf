from kvboost_rag.bench.front.run import main

main()
