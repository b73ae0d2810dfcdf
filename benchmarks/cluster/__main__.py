from benchmarks.cluster.run import main

main()
