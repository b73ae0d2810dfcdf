from kvboost_rag.bench.decode.run import main

main()
