from benchmarks.exactness.run import main

main()
