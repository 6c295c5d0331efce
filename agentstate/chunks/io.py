"""The IO engine: bounded submission and completion of backend operations.

Like an io_uring submission queue with a fixed depth: every chunk read or write of a store goes
through one `IOEngine`, which keeps at most `depth` operations in flight across all concurrent
loads, so reads overlap each other and the copies into their destinations without flooding the
thread pools. `submit` returns a `Batch` of tasks that can be waited for with a deadline, or
cancelled; operations not yet started when cancelled never start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class IOEngine:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._gate: asyncio.Semaphore | None = None
        self.in_flight = 0
        self.peak_in_flight = 0
        self.submitted = 0
        self.completed = 0

    async def run(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run one operation when a slot is free."""
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.depth)
        self.submitted += 1
        async with self._gate:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            try:
                return await op()
            finally:
                self.in_flight -= 1
                self.completed += 1

    def submit(self, ops: Sequence[Callable[[], Awaitable[T]]]) -> Batch[T]:
        return Batch([asyncio.ensure_future(self.run(op)) for op in ops])

    async def gather(self, ops: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
        return await self.submit(ops).wait()


class Batch(Generic[T]):
    """Submitted operations: wait for all (optionally until a deadline), or cancel the rest."""

    def __init__(self, tasks: list[asyncio.Future[T]]) -> None:
        self.tasks = tasks

    async def wait(self) -> list[T]:
        try:
            return list(await asyncio.gather(*self.tasks))
        except BaseException:
            self.cancel()
            raise

    async def wait_until(self, timeout: float | None) -> bool:
        """Wait up to `timeout` seconds; True when everything finished."""
        if not self.tasks:
            return True
        _, pending = await asyncio.wait(self.tasks, timeout=timeout)
        return not pending

    def done(self) -> bool:
        return all(t.done() for t in self.tasks)

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()


def batches(sizes: Sequence[int], target_bytes: int) -> list[list[int]]:
    """Split indices into consecutive runs of about `target_bytes` (at least one item each)."""
    out: list[list[int]] = []
    run: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if run and total + size > target_bytes:
            out.append(run)
            run, total = [], 0
        run.append(i)
        total += size
    if run:
        out.append(run)
    return out
