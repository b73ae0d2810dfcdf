"""The shared tier's client: one Redis (or Valkey) server, or a Redis Cluster, by its URL.

One server: redis-py's own URLs, ``redis://[user:password@]host:port/db``, ``rediss://``
(TLS), ``unix:///path/redis.sock``. A cluster:
``redis-cluster://[user:password@]host:port[,host:port...]``, the seed nodes the client
asks for the cluster's layout (it finds the other masters and replicas from whichever
answers, so listing several lets it start while one is down). The scheme is LMCache's (its
Redis Cluster connector takes ``redis-cluster://host1:7000,host2:7000``) and the form other
cluster clients read (fred, camellia); redis-py has no cluster URL of its own
(``RedisCluster.from_url`` takes a plain ``redis://`` URL of one node), and a plain
``redis://`` URL cannot say whether it names a cluster without asking the server.
Keys shard by hash slot (no hash tags: each entry is one independent key, so a corpus
spreads over every master).

Every flight of commands the client sends is counted (``RoundTrips``): one command, or one
pipeline's batch to one node. The cluster client's layout queries count too; a new
connection's own setup (HELLO, AUTH, CLIENT SETINFO) is counted apart, as a connection.
"""

from __future__ import annotations

import threading
from typing import Any

from kvboost_rag.core.remote_url import is_cluster, parse_cluster_url


class RoundTrips:
    """Thread-safe counts of command flights and of connections opened."""

    def __init__(self) -> None:
        self._flights = self._connections = 0
        self._lock = threading.Lock()

    def add(self, connection: bool = False) -> None:
        with self._lock:
            if connection:
                self._connections += 1
            else:
                self._flights += 1

    @property
    def count(self) -> int:
        with self._lock:
            return self._flights

    @property
    def connections(self) -> int:
        with self._lock:
            return self._connections


def import_redis() -> Any:
    try:
        import redis
    except ImportError as error:
        raise ImportError(
            "remote_url needs the Redis client: pip install 'kvboost-rag[redis]'"
        ) from error
    return redis


def open_client(url: str, timeout: float, round_trips: RoundTrips) -> Any:
    """A client of ``url`` whose flights ``round_trips`` counts. Socket operations get
    ``timeout``. No retries on one server (the store's back-off decides when to try
    again); a cluster client retries once after refreshing its layout (a failover or a
    slot migration moved the key), which connects to the cluster now."""
    redis = import_redis()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    if not is_cluster(url):
        base = redis.connection.Connection
        if url.startswith("unix://"):
            base = redis.connection.UnixDomainSocketConnection
        elif url.startswith("rediss://"):
            base = redis.connection.SSLConnection
        return redis.Redis.from_url(
            url,
            retry=Retry(NoBackoff(), 0),
            connection_class=_counted(base, round_trips),
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
        )
    from redis.cluster import ClusterNode, RedisCluster

    parsed = parse_cluster_url(url)
    (host, port), *others = parsed.nodes
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return RedisCluster(
        url=f"redis://{netloc}",  # only a cluster built from a URL takes a connection class
        startup_nodes=[ClusterNode(h, p) for h, p in others],
        username=parsed.username,
        password=parsed.password,
        retry=Retry(NoBackoff(), 1),
        connection_class=_counted(redis.connection.Connection, round_trips),
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
    )


def _counted(base: type, round_trips: RoundTrips) -> type:
    """``base`` counting each flight it sends (every write goes through
    ``send_packed_command``: a single command, or a pipeline's packed batch) and each
    connection it opens (whose setup flights are its own, not the caller's)."""

    class Counted(base):  # type: ignore[misc, valid-type]
        _setting_up = False

        def on_connect_check_health(self, check_health: bool = True) -> None:
            round_trips.add(connection=True)
            self._setting_up = True
            try:
                super().on_connect_check_health(check_health)
            finally:
                self._setting_up = False

        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            if not self._setting_up:
                round_trips.add()
            super().send_packed_command(command, check_health)

    return Counted
