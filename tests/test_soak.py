"""Short soak (the long one is `python benchmarks/soak.py`): 64 sessions for a few seconds.

Nothing lost (every session resumes its last committed version bit-exact, also after a restart),
no error, and anonymous memory stops growing: the second half of the run peaks within 64 MiB
of the first half's peak (host tier, restore pool and the encoders' scratch are bounded at 32 MiB each).

The soak runs in a process of its own: a test worker's memory also holds what earlier tests in it
left for the collector and the allocator to give back (a CI run once measured 713 MiB at the start
and growth that was not the store's), so only a fresh process measures the store alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.soak import MiB, SoakReport

SECONDS = float(os.environ.get("AGENTSTATE_SOAK_SECONDS", "12"))
ROOT = Path(__file__).resolve().parent.parent
RUN = """
import asyncio, dataclasses, json, sys
from benchmarks.soak import soak
report = asyncio.run(soak(sys.argv[1], float(sys.argv[2]), sessions=64))
print(json.dumps(dataclasses.asdict(report)))
"""


def test_64_sessions_lose_nothing_and_memory_stays_bounded(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", RUN, str(tmp_path / "data"), str(SECONDS)], cwd=ROOT,
                          capture_output=True, text=True, timeout=SECONDS + 300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    fields = json.loads(done.stdout.strip().splitlines()[-1])
    report = SoakReport(**{f.name: fields[f.name] for f in dataclasses.fields(SoakReport)})
    report.rss = [tuple(r) for r in report.rss]  # type: ignore[misc]
    assert report.errors == [] and report.lost == []
    assert report.snapshots >= 2 * 64 and report.resumes >= 64  # every session went round more than once
    assert report.peak_anon(0.5, 1.01) <= report.peak_anon(0.1, 0.5) + 64 * MiB, report.rss
