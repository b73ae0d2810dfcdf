from kvboost_rag.bench.chat.run import main

main()
