from benchmarks.rag.run import main

main()
