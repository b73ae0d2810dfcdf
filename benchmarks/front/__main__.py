from benchmarks.front.run import main

main()
