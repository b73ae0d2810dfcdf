from kvboost_rag.bench.constrained.run import main

main()
