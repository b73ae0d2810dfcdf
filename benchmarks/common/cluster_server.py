"""A private Redis Cluster the tests and benchmarks start, break and stop: ``masters``
``redis-server --cluster-enabled yes`` processes (and ``replicas`` per master) on loopback
ports, joined by ``redis-cli --cluster create``, nothing persisted but each node's cluster
file (so a killed node started again rejoins). Nodes can be killed, failed over and
filled up, and a slot migrated between masters, halfway (ASK) or whole (MOVED).

Every wait is bounded (``WAIT_SECONDS``) and polls at most every 50 ms."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common.redis_server import DelayedLink, RedisProcess
from kvboost_rag.core.store.remote import import_redis

WAIT_SECONDS = 30.0  # the most a cluster may take to form, fail over or settle
NODE_TIMEOUT_MS = 1000  # cluster-node-timeout: a master unreachable this long fails over


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports nothing listens on (at the time of asking): held
    open together while chosen, so no two are the same."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


class ClusterProcess:
    """A cluster of ``masters`` (x ``1 + replicas``) nodes; ``nodes`` in creation order."""

    def __init__(self, folder: Path, masters: int = 3, replicas: int = 0, *args: str) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (scripts/setup.sh installs it)")
        self.cli, self.masters, self.replicas = cli, masters, replicas
        self.nodes: list[RedisProcess] = []
        count = masters * (1 + replicas)
        ports = free_ports(2 * count)  # each node's port and its cluster bus port
        for i in range(count):
            node_dir = folder / f"node{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            options = ["--cluster-enabled", "yes", "--cluster-port", str(ports[count + i])]
            options += ["--cluster-config-file", "nodes.conf"]
            options += ["--cluster-node-timeout", str(NODE_TIMEOUT_MS), *args]
            self.nodes.append(RedisProcess(node_dir, *options))
            self.nodes[-1].port = ports[i]
        self._links: list[DelayedLink] = []

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> ClusterProcess:
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            cmd = [self.cli, "--cluster", "create", *addresses, "--cluster-yes"]
            cmd += ["--cluster-replicas", str(self.replicas)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=WAIT_SECONDS)
            if done.returncode:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-500:]}")
            self.wait_until(self.healthy, "the cluster to form")
            self.wait_until(self.synced, "the replicas' first sync")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
        for link in self._links:
            link.close()

    def behind_links(self, delay: float) -> str:
        """Put every node behind a ``DelayedLink`` (``delay`` seconds each way) and make
        the cluster announce the links' ports, so a client's every flight crosses one;
        returns the URL of the links."""
        self._links = [DelayedLink(node.port, delay) for node in self.nodes]
        for node, link in zip(self.nodes, self._links):
            self.client(node).config_set("cluster-announce-port", link.port)
        ports = {link.port for link in self._links}
        announced = lambda: all(  # noqa: E731
            {int(n.split()[1].split(b":")[1].split(b"@")[0]) for n in self._cluster_nodes(node)}
            <= ports
            for node in self.nodes
        )
        self.wait_until(announced, "every node to announce its link")
        return "redis-cluster://" + ",".join(f"127.0.0.1:{link.port}" for link in self._links)

    def _cluster_nodes(self, node: RedisProcess) -> list[bytes]:
        return bytes(self.client(node).execute_command("CLUSTER", "NODES")).splitlines()

    def client(self, node: RedisProcess) -> Any:
        """A plain client of one node (our own, patient enough for large values)."""
        return import_redis().Redis(host="127.0.0.1", port=node.port, socket_timeout=30)

    def running(self) -> list[RedisProcess]:
        return [n for n in self.nodes if n.process is not None]

    def primaries(self) -> list[RedisProcess]:
        """The nodes that are masters now, as the running nodes see it."""
        return [n for n in self.running() if self.role(n) == "master"]

    def role(self, node: RedisProcess) -> str:
        return str(self.client(node).info("replication")["role"])

    def keys_per_master(self, match: bytes = b"*") -> dict[int, int]:
        """Port -> keys matching ``match`` on each master."""
        return {n.port: len(self.client(n).keys(match)) for n in self.primaries()}

    def healthy(self) -> bool:
        """Every running node says the cluster is ok and every slot is served."""
        for node in self.running():
            try:
                info = self.client(node).cluster("info")
            except Exception:  # noqa: BLE001 -- still starting or just killed: not healthy
                return False
            if info.get("cluster_state") != "ok" or int(info["cluster_slots_ok"]) != 16384:
                return False
        return True

    def synced(self) -> bool:
        """Every running replica is connected to its master (only then can it fail over)."""
        replicas = [self.client(n).info("replication") for n in self.running()]
        return all(r.get("master_link_status") == "up" for r in replicas if r["role"] == "slave")

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_SECONDS
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {WAIT_SECONDS:.0f} s waiting for {what}")
            time.sleep(0.05)

    def owner(self, slot: int) -> RedisProcess:
        """The master serving ``slot`` now."""
        for start, end, master, *_ in self.client(self.running()[0]).execute_command(
            "CLUSTER", "SLOTS"
        ):
            if start <= slot <= end:
                return next(n for n in self.nodes if n.port == master[1])
        raise LookupError(f"slot {slot} is not served")

    def slot(self, key: bytes) -> int:
        return int(self.client(self.running()[0]).execute_command("CLUSTER", "KEYSLOT", key))

    def replica_of(self, master: RedisProcess) -> RedisProcess:
        for node in self.running():
            info = self.client(node).info("replication")
            if info["role"] == "slave" and info["master_port"] == master.port:
                return node
        raise LookupError(f"no replica of the master on port {master.port}")

    def node_id(self, node: RedisProcess) -> str:
        return str(self.client(node).execute_command("CLUSTER", "MYID").decode())

    def fail_over(self, replica: RedisProcess) -> RedisProcess:
        """A manual failover (CLUSTER FAILOVER on the replica): it becomes master and its
        master its replica; returns the old master."""
        master = next(n for n in self.nodes if n.port == self._master_port(replica))
        self.client(replica).execute_command("CLUSTER", "FAILOVER")
        swapped = lambda: self.role(replica) == "master" and self.role(master) == "slave"  # noqa: E731
        self.wait_until(swapped, "the failover")
        self.wait_until(lambda: self.healthy() and self.synced(), "the cluster to settle")
        return master

    def _master_port(self, replica: RedisProcess) -> int:
        return int(self.client(replica).info("replication")["master_port"])

    def start_migrating(self, slot: int, target: RedisProcess, share: float = 0.5) -> list[bytes]:
        """Mark ``slot`` migrating from its owner to ``target`` and move ``share`` of its
        keys there (the rest stay: reads of moved keys get ASK); returns the moved keys."""
        source = self.owner(slot)
        src, dst = self.client(source), self.client(target)
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(target))
        keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10_000)
        moved = keys[: int(len(keys) * share)]
        if moved:
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 10_000, "KEYS", *moved)
        return list(moved)

    def finish_migrating(self, slot: int, target: RedisProcess) -> None:
        """Move the rest of ``slot``'s keys to ``target`` and give it the slot (clients
        still sending there to the old owner get MOVED)."""
        source = self.owner(slot)
        src = self.client(source)
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000):
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 10_000, "KEYS", *keys)
        target_id = self.node_id(target)
        others = [n for n in self.primaries() if n not in (target, source)]
        for node in [target, source, *others]:  # the order the Redis manual gives
            self.client(node).execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        self.wait_until(lambda: self.owner(slot) is target, "the slot to move")

    def __enter__(self) -> ClusterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
