"""bench (all): every workload and system in one run, and the README section it writes."""
