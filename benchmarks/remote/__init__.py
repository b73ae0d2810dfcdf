"""bench remote: a corpus warmed on one machine served from another through Redis."""
