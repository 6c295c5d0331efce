"""Plumbing of the Mooncake tier: the registered arena, the guard, the daemon worker pool.

Apart from the backend because none of it is about Mooncake's API: it is what a blocking client
that can hang (for seconds, or ~90 s in a setup against a dead master) needs around it.
"""

from __future__ import annotations

import ctypes
import mmap
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


class Guard:
    """Lets a worker touch caller memory (sinks, values to copy) only while the caller still waits.

    A call that timed out keeps running on its thread; without this it could copy from a value
    buffer or call a sink after the caller has moved on and reused that memory.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._abandoned = False

    @contextmanager
    def live(self) -> Iterator[bool]:
        with self._lock:
            yield not self._abandoned

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True


class Slot:
    """One worker's part of the arena: `size` bytes at address `addr`, seen as `view`."""

    def __init__(self, view: memoryview, addr: int) -> None:
        self.view, self.addr, self.size = view, addr, len(view)


class Arena:
    """One anonymous mapping (page aligned, backed only where touched), cut into equal slots.

    Registered once with the transfer engine, so transfers read and write it directly. A worker
    takes a slot for the length of one call; with one slot per worker, taking never waits. The
    mapping is never unmapped: a worker stuck past its caller's timeout may still be using it.
    """

    def __init__(self, nbytes: int, slots: int) -> None:
        self.memory = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE * slots))
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
        self.size = len(self.memory)
        share = self.size // slots
        self._free: queue.Queue[Slot] = queue.Queue()
        for i in range(slots):
            self._free.put(Slot(memoryview(self.memory)[i * share : (i + 1) * share], self.addr + i * share))

    @contextmanager
    def slot(self) -> Iterator[Slot]:
        slot = self._free.get()
        try:
            yield slot
        finally:
            self._free.put(slot)


class DaemonPool(Executor):
    """A fixed pool of daemon threads. ThreadPoolExecutor joins its threads at interpreter exit,
    so one call stuck in the client (a dead master) would hold the process up to ~90 s."""

    def __init__(self, threads: int, name: str) -> None:
        self._work: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()
        self._shut = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if self._shut:
            raise RuntimeError("pool is shut down")
        future: Future[T] = Future()
        self._work.put((future, lambda: fn(*args, **kwargs)))
        return future

    def _loop(self) -> None:
        while (item := self._work.get()) is not None:
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued (its caller timed out): never run it
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 (handed to the caller, as ThreadPoolExecutor does)
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the threads once the queued work is done (or cancelled); waits only if asked."""
        self._shut = True
        while cancel_futures:
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._work.put(None)
        if wait:
            for t in self._threads:
                t.join()
