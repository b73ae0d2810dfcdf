"""Running requests: sampling, decoding, streaming and results."""
