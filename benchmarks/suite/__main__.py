from benchmarks.suite.run import main

main()
