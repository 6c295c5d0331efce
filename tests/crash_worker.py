"""A process that snapshots sessions in a loop until it is SIGKILLed (crash-consistency tests).

    python -m tests.crash_worker DIR LOG

runs as a *zygote*: it imports torch and agentstate once, then reads commands on stdin, so a
test can kill and restart the writer dozens of times without paying the import each time:

    fork SEED   -> forks a writer (prints its pid); the writer opens DIR and snapshots forever
    wait PID    -> reaps that writer (prints its wait status)

No torch operation runs in the zygote before a fork (a thread pool started before fork() would
be copied without its threads). What version v of session s holds follows from (s, v) alone
(`payload`), so a verifier regenerates it and compares bits. Versions in one *epoch* (v // 4)
share a token prefix, so snapshots reuse chunks and drop tails; a new epoch replaces every
chunk, so old ones lose their last reference. The writer appends `<op> <session> <version>` to
LOG (O_APPEND, fsync) only after the call returned: a logged snapshot must survive any kill.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from pathlib import Path

from agentstate import StateStore, StoreConfig
from agentstate.config import TierConfig
from agentstate.errors import SessionNotFoundError
from tests.conftest import SPEC4, random_kv, random_tokens

SESSIONS = [f"s{i}" for i in range(6)]
LENGTHS = (300, 451, 200, 517)  # tokens of versions 4e+1 .. 4e+4 of an epoch e: tails of every size


def crash_config(data: Path) -> StoreConfig:
    """Host cache over a file tier over LMDB (the record tier): every kind of local write a crash can cut.
    Chunks (128 KiB) and tails of 32 tokens or more go to LMDB's value log, smaller tails into LMDB's
    map; 1 MiB segments roll over every few chunks, so kills land in rollovers, removals and
    compactions of segments too."""
    tiers = [TierConfig(kind="host", capacity_bytes=4 << 20), TierConfig(kind="file", capacity_bytes=8 << 20),
             TierConfig(kind="lmdb", path=Path("chunks"))]  # fmt: skip
    return StoreConfig(path=data, tiers=tiers, chunk_tokens=64, lmdb_map_size=64 << 20,
                       lmdb_value_log_min_bytes=64 << 10, lmdb_segment_bytes=1 << 20)  # fmt: skip


def payload(session: str, version: int) -> tuple[list[int], int]:
    """Tokens of `version` of `session`, and the seed of its KV (KV of token i depends on the epoch only)."""
    epoch = (version - 1) // len(LENGTHS)
    seed = 7919 * (int(session[1:]) + 1) + epoch
    length = LENGTHS[(version - 1) % len(LENGTHS)]
    return random_tokens(max(LENGTHS), seed=seed)[:length], seed


def expected_kv(session: str, version: int):  # type: ignore[no-untyped-def]
    tokens, seed = payload(session, version)
    return random_kv(SPEC4, max(LENGTHS), seed=seed)[:, :, : len(tokens)]


async def write_forever(data: Path, log: Path, seed: int) -> None:
    rng = random.Random(seed)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def note(line: str) -> None:
        os.write(fd, line.encode() + b"\n")
        os.fsync(fd)

    async with StateStore.open(crash_config(data), SPEC4) as store:
        while True:
            session = rng.choice(SESSIONS)
            try:
                version = (await store.session(session)).version + 1
            except SessionNotFoundError:
                version = 1
            if rng.random() < 0.08 and version > 1:
                note(f"deleting {session} {version - 1}")
                await store.delete(session)
                note(f"deleted {session} {version - 1}")
                continue
            tokens, _ = payload(session, version)
            await store.snapshot(session, tokens, expected_kv(session, version).contiguous(), state={"v": version})
            note(f"snapshot {session} {version}")


def zygote(data: Path, log: Path) -> None:
    for line in sys.stdin:
        cmd, arg = line.split()
        if cmd == "fork":
            pid = os.fork()
            if pid == 0:
                try:
                    asyncio.run(write_forever(data, log, int(arg)))
                finally:
                    os._exit(1)  # only reached on an error: the writer loops until killed
            print(pid, flush=True)
        elif cmd == "wait":
            _, status = os.waitpid(int(arg), 0)
            print(status, flush=True)


if __name__ == "__main__":
    zygote(Path(sys.argv[1]), Path(sys.argv[2]))
