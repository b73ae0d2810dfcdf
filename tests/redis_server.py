"""The tests' private ``redis-server``: the benchmark's ``RedisProcess`` (a real server on a
free loopback port in a temp folder, killed, frozen or restarted by the test), skipped
where the Debian package is missing outside CI. No mocks: the shared tier's behaviour
under eviction, faults and concurrent writers is the server's."""

from __future__ import annotations

import os
import shutil

import pytest

from kvboost_rag.bench.fault_server import RedisProcess, Trickle, free_port

__all__ = ["RedisProcess", "Trickle", "free_port", "require_binary"]


def require_binary() -> None:
    if shutil.which("redis-server") is None:
        why = "redis-server is not installed (scripts/setup.sh installs Debian's redis-server)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
