"""Studies of the engine: programs that print tables and write JSON (never timed unit
tests). Not in the wheel: run them from a clone, ``python -m benchmarks.<name>``, from the
repository root. What a user runs on their own machine and model is ``kvboost-rag bench``
(``kvboost_rag.bench``)."""
