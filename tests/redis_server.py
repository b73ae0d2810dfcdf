"""The tests' private ``redis-server``: the benchmark's ``RedisProcess`` (a real server on a
free loopback port in a temp folder, killed, frozen or restarted by the test) and
``ClusterProcess`` (a real Redis Cluster of such servers, on loopback only), skipped where
the Debian package is missing outside CI. No mocks: the shared tier's behaviour under
eviction, faults, failovers, slot migrations and concurrent writers is the server's."""

from __future__ import annotations

import os
import shutil

import pytest

from benchmarks.common.cluster_server import ClusterProcess
from benchmarks.common.redis_server import RedisProcess, Trickle, free_port

__all__ = ["VALUES", "ClusterProcess", "RedisProcess", "Trickle", "free_port", "require_binary"]

# The names of the KV values the default namespace holds (not its passage catalogue list,
# ``<namespace>:<fingerprint>:passages``: a value's name ends in its key's hex digest).
VALUES = b"kvboost:*:[0-9a-f]*"


def require_binary(*names: str) -> None:
    """Skip (fail in CI) unless redis-server and the other named binaries are installed."""
    for name in ("redis-server", *names):
        if shutil.which(name) is None:
            why = f"{name} is not installed (scripts/setup.sh installs Debian's redis-server)"
            if os.environ.get("CI"):
                pytest.fail(why)
            pytest.skip(why)
