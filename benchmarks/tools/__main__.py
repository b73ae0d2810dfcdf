from benchmarks.tools.run import main

main()
