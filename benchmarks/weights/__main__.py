from benchmarks.weights.run import main

main()
