"""bench front: the fidelity front (TTFT speed-up against accuracy kept) of every reuse option."""
