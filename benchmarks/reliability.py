"""The long variants of the reliability suite; figures go to docs/reliability.md.

    python benchmarks/reliability.py [--kills 200] [--soak-seconds 120]

1. Crash consistency: `--kills` SIGKILLs of a snapshotting writer at random points (the CI test
   does 50), each followed by a full check of every session (tests/test_crash.py).
2. Soak: 64 sessions for `--soak-seconds` (benchmarks/soak.py; the CI test runs 12 s).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.soak import render, soak, write_section  # noqa: E402
from tests.test_crash import kill_loop  # noqa: E402

DOC = REPO / "docs" / "reliability.md"


def crash_section(counts: dict[str, int], seconds: float, command: str) -> str:
    rows = "\n".join(f"| {k.replace('_', ' ')} | {v} |" for k, v in counts.items())
    return (
        f"Command: `{command}`\n\n| crash consistency | |\n|---|---|\n{rows}\n| seconds | {seconds:.0f} |\n"
        "| sessions lost, mixed or wrong | 0 (any would have stopped the run) |\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--soak-seconds", type=float, default=120)
    args = ap.parse_args()
    command = f"python benchmarks/reliability.py --kills {args.kills} --soak-seconds {args.soak_seconds:g}"
    work = Path(tempfile.mkdtemp(prefix="agentstate-reliability-"))
    try:
        t0 = time.perf_counter()
        counts = asyncio.run(kill_loop(work / "crash", work / "ops.log", args.kills))
        body = crash_section(counts, time.perf_counter() - t0, command)
        print(body)
        write_section(DOC, body, "crash")
        report = asyncio.run(soak(work / "soak", args.soak_seconds, 64))
        body = render(report, command)
        print(body)
        for line in (report.errors + report.lost)[:10]:
            print("!", line)
        write_section(DOC, body, "soak")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
