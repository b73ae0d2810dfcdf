from benchmarks.constrained.run import main

main()
