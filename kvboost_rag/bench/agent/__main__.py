from kvboost_rag.bench.agent.run import main

main()
