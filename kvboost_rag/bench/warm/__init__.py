"""bench warm: warming the essay corpus and serving it from a fresh process."""
