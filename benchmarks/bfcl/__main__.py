"""bench bfcl: the Berkeley Function Calling Leaderboard's questions, scored by its checker."""

from benchmarks.bfcl.run import main

main()
