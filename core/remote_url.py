"""Where the shared tier is: a Redis (or Valkey) server's URL or a Redis Cluster's seed
nodes, checked and parsed without any client (``KVBoostConfig`` checks ``remote_url`` with
these; ``store/redis_client.py`` connects). The cluster scheme, ``redis-cluster://``, is
explained there."""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import unquote, urlsplit, urlunsplit

CLUSTER_SCHEME = "redis-cluster://"
SERVER_SCHEMES = ("redis://", "rediss://", "unix://")


class ClusterURL(NamedTuple):
    nodes: list[tuple[str, int]]  # seed nodes, in the URL's order
    username: str | None
    password: str | None


def is_cluster(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEME)


def check_url(url: str) -> None:
    """Raise ``ValueError`` naming the fix unless ``url`` is a server or cluster URL."""
    if is_cluster(url):
        parse_cluster_url(url)
    elif not url.startswith(SERVER_SCHEMES):
        raise ValueError(
            "remote_url must be a redis://, rediss:// or unix:// URL (one server) or "
            f"redis-cluster://host:port[,host:port...] (a Redis Cluster), got {redact(url)!r}"
        )
    else:
        try:  # a port out of range or not a number, found here rather than at the first write
            _ = urlsplit(url).port
        except ValueError as error:
            raise ValueError(f"remote_url {redact(url)!r}: {error}") from None


def parse_cluster_url(url: str) -> ClusterURL:
    """The seed nodes and credentials of a ``redis-cluster://`` URL."""
    assert is_cluster(url)
    rest = url[len(CLUSTER_SCHEME) :]
    userinfo, _, hosts = rest.rpartition("@")
    hosts, slash, path = hosts.partition("/")
    example = "e.g. redis-cluster://10.0.0.1:7000,10.0.0.2:7000"
    if path not in ("", "0") or "?" in hosts:
        raise ValueError(
            f"remote_url {redact(url)!r}: a cluster has only database 0 and takes no options; "
            f"give its nodes only, {example}"
        )
    nodes = [_node(url, part, example) for part in hosts.split(",")]
    user, colon, password = userinfo.partition(":")
    return ClusterURL(nodes, unquote(user) or None, unquote(password) if colon else None)


def _node(url: str, part: str, example: str) -> tuple[str, int]:
    host, _, port = part.strip().rpartition(":")
    host = host.strip("[]")  # [::1]:7000
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"remote_url {redact(url)!r}: every cluster node needs host:port, got {part!r}; "
            f"{example}"
        )
    return host, int(port)


def redact(url: str) -> str:
    """``url`` without its password (for messages and stats); cluster URLs too."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hosts}"))
