"""A real redis-server on loopback for tests: started on a free port, stopped by PID."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.ports import free_redis_port
from tests.requires import skip_or_fail


def free_port() -> int:
    """A free loopback port whose cluster bus port (port + 10000) is free and valid too."""
    return free_redis_port()


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        if shutil.which("redis-server") is None:
            skip_or_fail("redis-server not installed (apt-get install -y redis-server; .ci/run does)")
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.extra: list[str] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


class RedisCluster:
    """Three masters on loopback ports, no replicas, formed with `redis-cli --cluster create`."""

    def __init__(self, workdir: Path, extra: list[str] | None = None) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            skip_or_fail("redis-server/redis-cli not installed (.ci/run installs them)")
        self.nodes = [RedisServer(workdir / f"n{i}") for i in range(3)]
        self.node_extra = extra or []
        for node in self.nodes:
            node.workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.extra = ["--cluster-enabled", "yes", "--cluster-config-file", str(node.workdir / "nodes.conf"),
                          "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no",
                          *self.node_extra]  # fmt: skip
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            # Every node must agree: one that has not heard the slot map yet answers CLUSTERDOWN.
            infos = [subprocess.run(["redis-cli", "-p", str(n.port), "cluster", "info"],
                                    capture_output=True, text=True).stdout for n in self.nodes]  # fmt: skip
            if all("cluster_state:ok" in i and "cluster_slots_ok:16384" in i for i in infos):
                return self
            time.sleep(0.1)
        raise RuntimeError("redis cluster did not become ready")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
