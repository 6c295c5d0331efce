"""The disk's cold read ceiling, measured honestly: a sweep of fio configurations and a Python read,
each checked against the bytes the device really delivered during it.

A "cold" figure that read less from the device than it returned came (partly) from the page cache,
or re-read one region (fio's mmap engine with several jobs does: 10 GB/s "cold" from 0.5 GB read).
Device bytes here are this process's own storage reads, `/proc/self/io` read_bytes (every thread,
and, once reaped, its children: fio; the kernel adds a waited-for child's IO to its parent's): unlike
`/proc/diskstats`, they do not count what other processes on a shared VM re-read after a
`drop_caches`, and unlike pgpgin they are per process. A read is taken as cold only when
device bytes >= 95% of its payload; the others are dropped from the ceiling and listed as such.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GB = 1e9
COLD_MIN = 0.95  # device bytes / payload below this: not a cold read


def device_read_bytes() -> int | None:
    """Bytes this process and its reaped children caused to be read from storage; None if unknown."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return None


def drop_caches() -> bool:
    """Write back, then drop the page cache (root only); False where not permitted."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class Read:
    """One measured read: its rate, what it returned and what the device delivered meanwhile."""

    name: str
    gbps: float
    payload: int
    device: int | None

    @property
    def ratio(self) -> float | None:
        return None if self.device is None or not self.payload else self.device / self.payload

    @property
    def cold(self) -> bool:
        """Proven cold: the device delivered (nearly) every byte. Unknown counts as not proven."""
        return self.ratio is not None and self.ratio >= COLD_MIN


def lay_out(path: Path, size: int) -> None:
    """Write `size` bytes of random data to `path` and fsync it (incompressible, so no device trick)."""
    rng = np.random.default_rng(0)
    piece = rng.integers(0, 256, 8 << 20, dtype=np.uint8)
    with open(path, "wb", buffering=0) as f:
        for off in range(0, size, len(piece)):
            f.write(memoryview(piece)[: min(len(piece), size - off)])
            piece[:8] = rng.integers(0, 256, 8, dtype=np.uint8)  # no two pieces alike
        os.fsync(f.fileno())


def fio_read(path: Path, size: int, *, direct: bool, jobs: int, bs: str, depth: int) -> Read | None:
    """fio io_uring sequential read of `path`, each of `jobs` streams on its own slice; cold start."""
    part = size // jobs >> 20
    name = f"fio {'O_DIRECT' if direct else 'buffered'} jobs={jobs} bs={bs} QD{depth}"
    cmd = ["fio", "--name=ceiling", f"--filename={path}", f"--size={part}M", f"--offset_increment={part}M",
           f"--numjobs={jobs}", "--group_reporting", "--rw=read", f"--bs={bs}", f"--direct={int(direct)}",
           "--ioengine=io_uring", f"--iodepth={depth}", "--invalidate=1", "--output-format=json"]  # fmt: skip
    return _run_fio(name, cmd)


def _run_fio(name: str, cmd: list[str]) -> Read | None:
    """Run one fio read job after drop_caches, with the device bytes read meanwhile; None if fio failed."""
    drop_caches()
    before = device_read_bytes()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    after = device_read_bytes()
    if proc.returncode != 0:
        return None
    read = json.loads(proc.stdout)["jobs"][0]["read"]
    device = None if before is None or after is None else after - before
    return Read(name, read["bw_bytes"] / GB, int(read["io_bytes"]), device)


def python_read(path: Path, size: int, threads: int, piece: int = 8 << 20) -> Read:
    """`threads` threads of os.preadv in `piece`s into touched memory, each piece first announced
    with POSIX_FADV_WILLNEED: the best a Python reader of this disk does (what the file tier does)."""
    buf = np.ones(size, dtype=np.uint8)  # touched: time the read, not first-touch faults
    view = memoryview(buf)
    drop_caches()
    fd = os.open(path, os.O_RDONLY)

    def one(off: int) -> None:
        n = min(piece, size - off)
        os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
        done = 0
        while done < n:
            got = os.preadv(fd, [view[off + done : off + n]], off + done)
            if got == 0:
                raise OSError("file ended early")
            done += got

    try:
        before = device_read_bytes()
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(0, size, piece)))
        secs = time.perf_counter() - t
        after = device_read_bytes()
    finally:
        os.close(fd)
    device = None if before is None or after is None else after - before
    return Read(f"python {threads} threads preadv 8 MiB + WILLNEED", size / GB / secs, size, device)


def sweep(path: Path, size: int) -> list[Read]:
    """fio buffered and O_DIRECT x jobs 1/4/8 x bs 1M/4M x QD 16/32 (io_uring), the mmap control
    (which must come out not cold), then Python 4/8 threads; the file is laid out first if missing.
    Without fio only the Python reads run."""
    if not path.exists():
        lay_out(path, size)
    out: list[Read] = []
    if shutil.which("fio") is not None:
        for direct in (False, True):
            for jobs in (1, 4, 8):
                for bs in ("1M", "4M"):
                    for depth in (16, 32):
                        if (r := fio_read(path, size, direct=direct, jobs=jobs, bs=bs, depth=depth)) is not None:
                            out.append(r)
        out.append(fio_trap(path, size))
    out += [python_read(path, size, 4), python_read(path, size, 8)]
    return out


def fio_trap(path: Path, size: int, jobs: int = 8) -> Read | None:
    """A control the check must drop: fio's mmap engine with `jobs` jobs all on one slice reports
    jobs x the slice at page-cache speed while the device reads the slice once."""
    part = size // jobs >> 20
    cmd = ["fio", "--name=trap", f"--filename={path}", f"--size={part}M", "--offset_increment=0",
           f"--numjobs={jobs}", "--group_reporting", "--rw=read", "--bs=1M", "--ioengine=mmap",
           "--invalidate=1", "--output-format=json"]  # fmt: skip
    return _run_fio(f"fio mmap jobs={jobs}, one shared slice (control)", cmd)


def best(reads: list[Read]) -> Read | None:
    """The fastest read proven cold: the ceiling."""
    return max((r for r in reads if r.cold), key=lambda r: r.gbps, default=None)


def describe(reads: list[Read]) -> list[str]:
    """Markdown: the sweep as a table, dropped configurations marked."""
    lines = ["| disk read (cold) | GB/s | device / payload | counted |", "|---|---:|---:|---|"]
    top = best(reads)
    for r in sorted(reads, key=lambda r: -r.gbps):
        ratio = "?" if r.ratio is None else f"{r.ratio:.2f}"
        verdict = "**ceiling**" if r is top else "yes" if r.cold else "dropped: not cold"
        lines.append(f"| {r.name} | {r.gbps:.2f} | {ratio} | {verdict} |")
    return lines
