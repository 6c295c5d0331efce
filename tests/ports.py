"""Loopback ports for the servers the tests start, chosen so that nothing else takes them first.

`bind(0)` hands out a port from the kernel's ephemeral range and forgets it: a server that binds it
30 s later (an SGLang server spends that long importing) can find it taken by any outgoing
connection, a vLLM engine's own `bind(0)`, or another test worker that asked at the same moment.
One CI run lost a whole SGLang module that way (`[Errno 98] address already in use`). So ports come
from below the ephemeral range and outside SGLang's own pick for its NCCL port (22000-29999), each
one reserved with a marker file that every test process on the machine sees (xdist workers and the
vLLM venv's run alike), and checked with a bind.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

LOW, HIGH = 10000, 21999  # servers; below SGLang's 22000-29999 and the ephemeral range (32768+)
REDIS_LOW, REDIS_HIGH = 2000, 11999  # a Redis node's cluster bus port is its port + 10000
STALE_S = 3600.0  # a marker older than this belongs to a run that is over
MARKERS = Path(tempfile.gettempdir()) / "agentstate-test-ports"


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _reserve(port: int) -> bool:
    """Claim `port` for this process unless a live claim by another one exists."""
    MARKERS.mkdir(parents=True, exist_ok=True)
    marker = MARKERS / str(port)
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            if time.time() - marker.stat().st_mtime < STALE_S:
                return False
            marker.unlink()  # a claim from a run long over
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except (FileNotFoundError, FileExistsError):  # another process got there in between
            return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def free_port(low: int = LOW, high: int = HIGH, also: tuple[int, ...] = ()) -> int:
    """A port in [low, high] that binds now and that no other test process has claimed recently;
    `also` are offsets of companion ports (a Redis cluster bus) that must bind too."""
    high = min(high, _ephemeral_low() - 1 - max(also, default=0))
    for port in random.sample(range(low, high + 1), min(512, high - low + 1)):
        ports = [port, *(port + d for d in also)]
        if all(_bindable(p) for p in ports) and all(_reserve(p) for p in ports):
            return port
    raise RuntimeError(f"no free loopback port in {low}-{high}")


def free_redis_port() -> int:
    """A free port for a Redis node whose cluster bus port (port + 10000) is free too."""
    return free_port(REDIS_LOW, REDIS_HIGH, also=(10000,))


def address_in_use(log: str) -> bool:
    """Whether a server's log says it lost its port to someone else."""
    return "address already in use" in log.lower() or "errno 98" in log.lower()
