from benchmarks.decode.run import main

main()
