"""Soak: concurrent sessions snapshotting and resuming for a bounded time, memory watched.

    python benchmarks/soak.py [--seconds 120] [--sessions 64]   # writes docs/reliability.md (section soak)

Each session is a task that, until the deadline, resumes its last version, checks it bit for bit,
and snapshots the next one. Versions of one *epoch* (v // 4) extend one token sequence, so
snapshots reuse chunks and replace tails; a new epoch starts over with new tokens, so the old
chunks lose their last reference and are deleted: the store keeps churning instead of only
growing. The host tier is small (evictions and promotions run all the time) and the restore pool
bounded. RSS and anonymous RSS (RssAnon: heap and buffers, not LMDB's file-backed mmap pages) are
sampled every 0.2 s. At the end the store is closed and reopened, and every session must resume
bit-exact at its last committed version. tests/test_soak.py runs a short variant.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agentstate import StateStore, StoreConfig  # noqa: E402
from benchmarks import doc_section  # noqa: E402
from agentstate.config import TierConfig  # noqa: E402
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens  # noqa: E402

EPOCH = 4
STEP = 160  # tokens each version adds: chunk boundaries fall at many offsets of the tail
MiB = 1 << 20


def content(session: int, version: int) -> tuple[list[int], int, int]:
    """Tokens, KV seed and length of `version` of `session` (KV of token i depends on the epoch only)."""
    epoch, step = divmod(version - 1, EPOCH)
    seed = 104_729 * (session + 1) + epoch
    length = 40 + STEP * (step + 1)
    return random_tokens(40 + STEP * EPOCH, seed=seed)[:length], seed, length


def kv_of(session: int, version: int):  # type: ignore[no-untyped-def]
    _, seed, length = content(session, version)
    return random_kv(SPEC4, 40 + STEP * EPOCH, seed=seed)[:, :, :length].contiguous()


def soak_config(data: Path) -> StoreConfig:
    tiers = [TierConfig(kind="host", capacity_bytes=32 * MiB), TierConfig(kind="lmdb", path=Path("chunks"))]
    # The encoders' scratch (buffers of values LMDB copied, kept for the next encodes) is bounded by
    # io_depth x batch_bytes: 8 x 4 MiB here, like the host tier and the restore pool, so that a run
    # that fills it slowly (a loaded machine) still flattens within the test's margin.
    return StoreConfig(path=data, tiers=tiers, chunk_tokens=64, lmdb_map_size=256 * MiB, restore_pool_bytes=32 * MiB,
                       io_depth=8, batch_bytes=4 * MiB)  # fmt: skip


def memory() -> tuple[int, int]:
    """(RSS, RssAnon) of this process in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["RssAnon"].split()[0]) * 1024


@dataclass
class SoakReport:
    seconds: float
    sessions: int
    snapshots: int = 0
    resumes: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    errors: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    snapshot_ms: list[float] = field(default_factory=list)
    resume_ms: list[float] = field(default_factory=list)
    rss: list[tuple[float, int, int]] = field(default_factory=list)  # (t, rss, anon)

    def pct(self, values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    def peak_anon(self, start: float, end: float) -> int:
        """Highest anonymous RSS sampled in [start, end) as fractions of the run."""
        lo, hi = start * self.seconds, end * self.seconds
        return max((a for t, _, a in self.rss if lo <= t < hi), default=0)


async def soak(data: Path, seconds: float, sessions: int = 64) -> SoakReport:
    """Run the workload for `seconds`; everything it saw goes into the report, nothing raises."""
    report = SoakReport(seconds=seconds, sessions=sessions)
    committed: dict[int, int] = {}
    start = time.perf_counter()
    deadline = start + seconds

    async def session(s: int) -> None:
        sid = f"soak-{s}"
        while time.perf_counter() < deadline:
            try:
                version = committed.get(s, 0)
                if version:
                    t0 = time.perf_counter()
                    result = await store.resume(sid)
                    report.resume_ms.append((time.perf_counter() - t0) * 1e3)
                    report.resumes += 1
                    report.bytes_read += result.kv.numel() * result.kv.element_size()
                    if result.manifest.version != version or not bits_equal(result.kv, kv_of(s, version)):
                        report.lost.append(f"{sid} v{version}: resumed v{result.manifest.version}, or wrong bytes")
                tokens, _, _ = content(s, version + 1)
                kv = kv_of(s, version + 1)
                t0 = time.perf_counter()
                await store.snapshot(sid, tokens, kv, expected_version=version or None)
                report.snapshot_ms.append((time.perf_counter() - t0) * 1e3)
                report.snapshots += 1
                report.bytes_written += kv.numel() * kv.element_size()
                committed[s] = version + 1
            except Exception as exc:  # noqa: BLE001 - the soak counts every failure instead of stopping
                report.errors.append(f"{sid}: {type(exc).__name__}: {exc}")
                await asyncio.sleep(0.01)

    async def sample() -> None:
        while time.perf_counter() < deadline:
            rss, anon = memory()
            report.rss.append((time.perf_counter() - start, rss, anon))
            await asyncio.sleep(0.2)

    async with StateStore.open(soak_config(data), SPEC4) as store:
        await asyncio.gather(sample(), *(session(s) for s in range(sessions)))
    async with StateStore.open(soak_config(data), SPEC4) as store:  # after a restart: nothing lost
        for s, version in committed.items():
            result = await store.resume(f"soak-{s}")
            if result.manifest.version != version or not bits_equal(result.kv, kv_of(s, version)):
                report.lost.append(f"soak-{s} v{version} after restart")
    return report


def render(report: SoakReport, command: str) -> str:
    gib = 1 << 30
    early, late = report.peak_anon(0.1, 0.5), report.peak_anon(0.5, 1.01)
    peak_rss = max(r for _, r, _ in report.rss)
    rows = [
        ("sessions, seconds", f"{report.sessions}, {report.seconds:.0f}"),
        ("snapshots / resumes", f"{report.snapshots} / {report.resumes}"),
        ("GiB written / read (KV)", f"{report.bytes_written / gib:.2f} / {report.bytes_read / gib:.2f}"),
        ("errors / sessions lost or wrong", f"{len(report.errors)} / {len(report.lost)}"),
        ("snapshot p50 / p99 ms", f"{report.pct(report.snapshot_ms, 50):.1f} / {report.pct(report.snapshot_ms, 99):.1f}"),
        ("resume p50 / p99 ms", f"{report.pct(report.resume_ms, 50):.1f} / {report.pct(report.resume_ms, 99):.1f}"),
        ("peak RSS MiB", f"{peak_rss / MiB:.0f}"),
        ("peak anonymous RSS MiB, first half / second half", f"{early / MiB:.0f} / {late / MiB:.0f}"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return f"Command: `{command}`\n\n| soak | |\n|---|---|\n{table}\n"


def write_section(doc: Path, body: str, name: str) -> None:
    """Replace the generated section `name` of `doc` (or append it), leaving the hand-written rest."""
    begin = f"<!-- {name}:begin (generated by benchmarks/; edits inside are overwritten) -->"
    end = f"<!-- {name}:end -->"
    doc_section.write_section(doc, begin, end, f"{begin}\n{body}{end}", title="# Reliability")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--data-dir", type=Path, default=Path("/tmp/agentstate-soak"))
    args = ap.parse_args()
    import shutil

    shutil.rmtree(args.data_dir, ignore_errors=True)
    report = asyncio.run(soak(args.data_dir, args.seconds, args.sessions))
    body = render(report, f"python benchmarks/soak.py --seconds {args.seconds:g} --sessions {args.sessions}")
    print(body)
    for line in (report.errors + report.lost)[:10]:
        print("!", line)
    write_section(REPO / "docs" / "reliability.md", body, "soak")


if __name__ == "__main__":
    main()
