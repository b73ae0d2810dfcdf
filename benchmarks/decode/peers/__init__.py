"""Runners for the decode benchmark's peers, each run in its own environment (never
imported by the package)."""
