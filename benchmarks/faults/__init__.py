"""bench faults: the shared tier and the disk under faults; nothing raised, nothing wrong served."""
