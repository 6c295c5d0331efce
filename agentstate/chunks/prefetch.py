"""Prefetch: bring a matched prefix up to host memory while the request waits to be scheduled.

`await StateStore.prefetch(tokens)` starts reading, from the slow tiers, every matched chunk that is
not already in a memory tier, into owned host buffers (promoted into the host tier as they
arrive). The handle is what `StateStore.load(..., prefetch=handle)` completes under a policy:

- `wait_complete`: wait for every chunk.
- `best_effort`: take what arrived by the deadline (default: now); the rest is reported as not
  loaded and keeps arriving in the background, so a later load finds it.
- `timeout`: like best_effort with a deadline of `base + per_1k_tokens * tokens / 1000` seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Literal

from agentstate.chunks.io import Batch
from agentstate.chunks.tiers import Value

PrefetchPolicy = Literal["wait_complete", "best_effort", "timeout"]


class PrefetchHandle:
    def __init__(self, keys: Sequence[str], pinned: Callable[[Iterable[str]], AbstractContextManager[None]]) -> None:
        self.keys = list(keys)
        self.staged: dict[str, Value] = {}
        self._batch: Batch[None] | None = None
        self._hold: AbstractContextManager[None] | None = pinned(self.keys)
        self._hold.__enter__()  # nothing this prefetch relies on is evicted or collected meanwhile

    def start(self, batch: Batch[None]) -> None:
        self._batch = batch
        if not batch.tasks:
            self._release()
            return
        remaining = len(batch.tasks)

        def finished(_: object) -> None:
            nonlocal remaining
            remaining -= 1
            if remaining == 0:
                self._release()

        for task in batch.tasks:
            task.add_done_callback(finished)

    def _release(self) -> None:
        if self._hold is not None:
            hold, self._hold = self._hold, None
            hold.__exit__(None, None, None)

    @property
    def done(self) -> bool:
        return self._batch is None or self._batch.done()

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait for the fetch (at most `timeout` seconds); True when it finished."""
        return True if self._batch is None else await self._batch.wait_until(timeout)

    def cancel(self) -> None:
        if self._batch is not None:
            self._batch.cancel()

    def ready(self, in_memory: Callable[[str], bool]) -> int:
        """How many leading keys can be copied now (staged, or held by a memory tier)."""
        for i, key in enumerate(self.keys):
            if key not in self.staged and not in_memory(key):
                return i
        return len(self.keys)


def deadline_for(
    policy: PrefetchPolicy, tokens: int, *, timeout: float | None, base: float, per_1k: float
) -> float | None:
    if policy == "wait_complete":
        return None
    if policy == "best_effort":
        return timeout if timeout is not None else 0.0
    return timeout if timeout is not None else base + per_1k * tokens / 1000
