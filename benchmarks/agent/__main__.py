from benchmarks.agent.run import main

main()
