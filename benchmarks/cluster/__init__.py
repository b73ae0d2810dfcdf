"""bench cluster: shared-tier round trips and lookup time of one request, per entry vs
batched, on one server and on a cluster."""
