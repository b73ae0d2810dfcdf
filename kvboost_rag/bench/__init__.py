"""Benchmarks: programs that print tables and write JSON (never timed unit tests)."""
