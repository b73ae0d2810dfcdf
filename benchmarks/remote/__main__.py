from benchmarks.remote.run import main

main()
