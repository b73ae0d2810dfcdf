from benchmarks.faults.run import main

main()
