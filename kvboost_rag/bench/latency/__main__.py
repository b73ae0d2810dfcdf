from kvboost_rag.bench.latency.run import main

main()
