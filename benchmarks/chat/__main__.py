from benchmarks.chat.run import main

main()
