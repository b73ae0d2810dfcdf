"""What a request reuses: the exact prefix and session caches, passages, the plan and repair."""
