"""Usage counts reach the catalog exactly once.

The store adds pending counts to the catalog every `usage_flush_s` and at close, and close cancels
the flush task. The LMDB catalog writes in a thread of its own: a cancel arriving while that
transaction runs does not stop it from committing. Counts put back as pending then were added a
second time by close's own flush (a CI run of the vLLM suite read 7 hints where 4 were sent, and
every load counted twice). Here the real LMDB catalog's transaction is made slow, so the cancel
lands inside it every time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agentstate import StateStore
from tests.conftest import SPEC4, random_kv, random_tokens


@pytest.mark.parametrize("outcome", ["commits", "fails"])
async def test_a_flush_cancelled_inside_its_write_counts_once(tmp_path: Path, outcome: str) -> None:
    tokens = random_tokens(100, seed=1)
    kv = random_kv(SPEC4, len(tokens), seed=1)
    inside, armed = threading.Event(), threading.Event()
    store = await StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=64, usage_flush_s=1.0)
    try:
        real = store.catalog._record  # the read inside add_usage's transaction, in the catalog's thread

        def slow(txn: Any, key: bytes) -> dict[str, object]:
            if armed.is_set() and not inside.is_set():  # the first usage write after the counts below
                inside.set()
                time.sleep(0.3)  # close's cancel arrives now
                if outcome == "fails":
                    raise OSError("the disk went away")
            return real(txn, key)

        store.catalog._record = slow  # type: ignore[method-assign]
        await store.snapshot("s", tokens, kv)
        await store.hint("s", "paused", 5)
        armed.set()  # the periodic flush, due within usage_flush_s, is the next to read a usage record
        assert await asyncio.to_thread(inside.wait, 10)  # it is inside its transaction
        store.catalog._record = real  # type: ignore[method-assign]  # close's own flush runs at full speed
    finally:
        await store.close()
    async with StateStore.open(tmp_path / "d", SPEC4, chunk_tokens=64, read_only=True) as again:
        usage = await again.usage("s")
        total = await again.usage()
    assert (usage.snapshots, usage.hints, usage.tokens_written) == (1, 1, 100), usage  # once, committed or not
    assert (total.snapshots, total.hints) == (1, 1), total
