"""What each way of storing a model's weights costs at rest: resident memory, start-up and
the conversion's peak memory (``python -m benchmarks.weights``)."""
