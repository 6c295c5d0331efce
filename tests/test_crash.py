"""Crash consistency: a writer SIGKILLed at random points, 50 times, loses nothing that returned.

After every kill a fresh store opens the directory and checks every session bit for bit against
what its version must hold (tests/crash_worker.py derives it from session and version), so a
manifest of one version over chunks or a tail of another is caught, as is a logged snapshot
that is gone or older. Every few kills gc runs and the record tier must hold exactly what the
manifests name: a crash leaves no garbage that gc cannot find.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path


from agentstate import StateStore
from agentstate.keys import CHUNK_PREFIX, TAIL_PREFIX
from tests.conftest import SPEC4, bits_equal
from tests.crash_worker import crash_config, expected_kv, payload

KILLS = int(os.environ.get("AGENTSTATE_CRASH_KILLS", "50"))
ROOT = Path(__file__).resolve().parent.parent


class Zygote:
    """The forking writer process of tests/crash_worker.py, driven over its stdin/stdout."""

    def __init__(self, data: Path, log: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.crash_worker", str(data), str(log)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def ask(self, line: str) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, f"zygote died (rc {self.proc.poll()})"
        return int(answer)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def expectations(log: Path) -> dict[str, tuple[str, int]]:
    """Per session, from the writer's log: ("present" | "maybe" | "absent", lowest allowed version)."""
    seen: dict[str, tuple[str, int]] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        op, session, version = line.split()
        if op == "snapshot":
            seen[session] = ("present", int(version))
        elif op == "deleting":
            seen[session] = ("maybe", int(version))
        else:
            seen[session] = ("absent", 0)
    return seen


async def check(data: Path, log: Path, *, sweep: bool) -> int:
    """Everything the log promises is there, bit-exact; returns the number of sessions checked."""
    async with StateStore.open(crash_config(data), SPEC4) as store:
        manifests = {m.session_id: m async for m in store.sessions()}
        for session, (status, floor) in expectations(log).items():
            if status == "present":
                assert session in manifests, f"{session}: its snapshot v{floor} returned, and it is gone"
            if session in manifests:
                assert manifests[session].version >= floor, f"{session}: v{manifests[session].version} < v{floor}"
        for session, manifest in manifests.items():
            tokens, _ = payload(session, manifest.version)
            assert manifest.tokens == tokens and manifest.state == {"v": manifest.version}, f"{session}: mixed"
            result = await store.resume(session)
            assert result.restored_tokens == len(tokens), f"{session} v{manifest.version}: stored data lost"
            assert bits_equal(result.kv, expected_kv(session, manifest.version)), f"{session}: wrong bytes"
        if sweep:
            await store.gc()
            named = {k for m in manifests.values() for k in m.chunk_keys}
            tails = {m.tail_key for m in manifests.values() if m.tail_key}
            held = {k async for k in store.chunks.backend(store.chunks.record_tier).keys(CHUNK_PREFIX)}
            held_tails = {k async for k in store.chunks.backend(store.chunks.record_tier).keys(TAIL_PREFIX)}
            assert held == named and held_tails == tails, "gc left garbage, or dropped what a manifest names"
            check_value_log(store.chunks.backend(store.chunks.record_tier))
        return len(manifests)


def check_value_log(backend: object) -> None:
    """After gc: every segment file left is named by a pointer (or is this process's own active
    one), its live bytes are what the pointers say, and dead bytes are bounded (compaction ran)."""
    import lmdb

    from agentstate.backends.lmdb import _pointers

    vlog = backend._log  # type: ignore[attr-defined]
    with backend._env.begin(db=backend._ptrs) as txn:  # type: ignore[attr-defined]
        pointers = [p for _, p in _pointers(txn)]
    live: dict[int, int] = {}
    for p in pointers:
        live[p.segment] = live.get(p.segment, 0) + p.length
        assert vlog.valid(p), f"a pointer past its segment's end: {p}"
    on_disk = {int(f.name[:-4]): f.stat().st_size for f in vlog.root.glob("*.seg")}
    assert set(on_disk) <= set(live) | {vlog._active}, f"unreferenced segments left: {set(on_disk) - set(live)}"
    assert {s: seg.live for s, seg in vlog._segments.items() if seg.live} == live, "live-byte accounting drifted"
    assert isinstance(lmdb.version(), tuple)
    sealed = sum(size for s, size in on_disk.items() if s != vlog._active)
    assert sealed <= 2 * sum(live.values()) + vlog.segment_bytes, "dead bytes were not reclaimed"


def snapshots_logged(log: Path) -> int:
    return sum(line.startswith("snapshot") for line in log.read_text().splitlines()) if log.exists() else 0


def wait_for_snapshot(log: Path, before: int) -> None:
    """Until the writer logged a snapshot past `before` (a loaded machine may take seconds to get there:
    a kill at a fixed delay would then land before any work, every time)."""
    deadline = time.monotonic() + 120
    while snapshots_logged(log) <= before:
        assert time.monotonic() < deadline, "the writer logged no snapshot in 120 s"
        time.sleep(0.01)


async def kill_loop(data: Path, log: Path, kills: int, seed: int = 20261202) -> dict[str, int]:
    """`kills` SIGKILLs of a writer at random points, each followed by a full check; returns counts."""
    rng = random.Random(seed)
    zygote = Zygote(data, log)
    checked = 0
    try:
        for kill in range(kills):
            before = snapshots_logged(log)
            pid = zygote.ask(f"fork {rng.randrange(1 << 30)}")
            if kill % 2:  # wait for this writer's first snapshot, then anywhere in what follows
                wait_for_snapshot(log, before)
            time.sleep(rng.uniform(0.05, 0.9))  # else anywhere: opening, writing chunks, committing, deleting
            os.kill(pid, signal.SIGKILL)
            status = zygote.ask(f"wait {pid}")
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"writer failed: {status}"
            checked += await check(data, log, sweep=kill % 10 == 9)
    finally:
        zygote.close()
    ops = log.read_text().splitlines()
    return {
        "kills": kills,
        "snapshots": sum(op.startswith("snapshot") for op in ops),
        "deletes": sum(op.startswith("deleted") for op in ops),
        "sessions_checked": checked,
    }


async def test_sigkilled_writer_loses_nothing_that_returned(tmp_path: Path) -> None:
    counts = await kill_loop(tmp_path / "data", tmp_path / "ops.log", KILLS)
    # half the kills land after their writer's first snapshot, so the log holds at least that many (the
    # kills landed mid-workload, not before it, whatever the machine's load)
    assert counts["snapshots"] >= KILLS // 2
