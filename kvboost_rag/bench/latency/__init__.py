"""bench latency: time to first and last token for one user at a time, against generate."""
