"""A second host, as a separate process: opens its own data directory over a shared Redis.

    python -m tests.shared_worker write DIR URL PREFIX     # snapshot session "s1" and a shared prefix
    python -m tests.shared_worker race  DIR URL PREFIX W N # N snapshots of session "race" as writer W

Prints one JSON line with what it did. The KV and tokens it writes follow from seeds, so the
test process can regenerate them and compare bits.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from agentstate import StateStore, StoreConfig
from agentstate.config import TierConfig
from agentstate.errors import ConflictError, SessionNotFoundError
from tests.conftest import SPEC4, random_kv, random_tokens

SESSION_TOKENS, PREFIX_TOKENS = 333, 256


def shared_config(data: Path, url: str, prefix: str, **overrides: Any) -> StoreConfig:
    """What every host of one fleet configures: its own host tier and LMDB, one shared cluster."""
    tiers = [TierConfig(kind="host", capacity_bytes=64 << 20), TierConfig(kind="lmdb"),
             TierConfig(kind="redis", url=url, cluster=True, prefix=prefix)]  # fmt: skip
    fields: dict[str, Any] = dict(path=data, tiers=tiers, chunk_tokens=64, lmdb_map_size=64 << 20,
                                  catalog_url=url, catalog_cluster=True, catalog_prefix=prefix)  # fmt: skip
    return StoreConfig(**{**fields, **overrides})


def race_payload(writer: int, i: int) -> tuple[list[int], int]:
    """Tokens and KV seed of writer W's i-th snapshot; lengths vary so tails and chunk counts differ."""
    seed = 1000 * writer + i
    return random_tokens(100 + 37 * ((writer + i) % 7), seed=seed), seed


async def write(cfg: StoreConfig) -> dict[str, Any]:
    async with StateStore.open(cfg, SPEC4) as store:
        m = await store.snapshot("s1", random_tokens(SESSION_TOKENS, seed=1), random_kv(SPEC4, SESSION_TOKENS, seed=1),
                                 state={"from": "host-a"})  # fmt: skip
        prefix = random_tokens(PREFIX_TOKENS, seed=2)
        stored = await store.put_prefix(prefix, random_kv(SPEC4, PREFIX_TOKENS, seed=2))
    return {"version": m.version, "prefix_stored": stored}


async def race(cfg: StoreConfig, writer: int, n: int) -> dict[str, Any]:
    won, lost = 0, 0
    async with StateStore.open(cfg, SPEC4) as store:
        for i in range(n):
            try:
                seen = (await store.session("race")).version
            except SessionNotFoundError:
                seen = 0
            tokens, seed = race_payload(writer, i)
            try:
                await store.snapshot("race", tokens, random_kv(SPEC4, len(tokens), seed=seed),
                                     state={"writer": writer, "i": i}, expected_version=seen)  # fmt: skip
                won += 1
            except ConflictError:
                lost += 1
    return {"won": won, "lost": lost}


def main(argv: list[str]) -> None:
    mode, data, url, prefix = argv[0], Path(argv[1]), argv[2], argv[3]
    cfg = shared_config(data, url, prefix)
    result = asyncio.run(write(cfg) if mode == "write" else race(cfg, int(argv[4]), int(argv[5])))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
