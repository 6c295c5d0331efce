"""Short soak (the long one is `python benchmarks/soak.py`): 64 sessions for a few seconds.

Nothing lost (every session resumes its last committed version bit-exact, also after a restart),
no error, and anonymous memory stops growing: the second half of the run peaks within 64 MiB
of the first half's peak (host tier and restore pool are bounded at 32 MiB each).
"""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.soak import MiB, soak

SECONDS = float(os.environ.get("AGENTSTATE_SOAK_SECONDS", "12"))


async def test_64_sessions_lose_nothing_and_memory_stays_bounded(tmp_path: Path) -> None:
    report = await soak(tmp_path / "data", SECONDS, sessions=64)
    assert report.errors == [] and report.lost == []
    assert report.snapshots >= 2 * 64 and report.resumes >= 64  # every session went round more than once
    assert report.peak_anon(0.5, 1.01) <= report.peak_anon(0.1, 0.5) + 64 * MiB, report.rss
