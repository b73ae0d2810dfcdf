from kvboost_rag.bench.faults.run import main

main()
