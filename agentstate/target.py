"""KVTarget: where restored chunks land, written straight into the engine's memory.

A restore decodes each chunk into a zero-copy view of canonical KV `[layers, planes, n, heads,
dim]` over the backend's memory and hands it to `target.write(start, src)`, which copies it into
place: a slice of a canonical tensor, or a scatter into a paged pool at the slots of tokens
`start .. start+n`. On CUDA the host source is first staged into pinned memory, then copied
non-blocking on a side stream, with one event per chunk so an engine can wait chunk by chunk;
`synchronize()` waits for all of them. On CPU the same calls are plain copies.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from agentstate.errors import InvalidArgumentError, KVShapeError
from agentstate.spec import ModelSpec

if TYPE_CHECKING:
    import torch

    from agentstate.layouts import NativeKV


class KVTarget(ABC):
    """Destination of a restore. `write` may be called from worker threads, for disjoint ranges."""

    num_tokens: int
    device: torch.device
    native_layout: int | None = None
    """The chunk layout (layouts.py) this target's memory is in, where it is not canonical: chunks
    stored in it arrive through `write_native`, as they are; any other is converted first."""

    @abstractmethod
    def _copy(self, start: int, src: torch.Tensor) -> None:
        """Copy `src` (canonical KV of `src.shape[2]` tokens, already on `self.device`) into place."""

    def write_native(self, start: int, n: int, src: NativeKV) -> None:
        """Copy the first `n` tokens of a chunk in `native_layout` into place at token `start`."""
        if self.native_layout is None or src.layout != self.native_layout:
            raise InvalidArgumentError(f"a chunk of layout {src.layout:#x} for a target of {self.native_layout}")
        if start < 0 or n < 0 or n > src.shape[2] or start + n > self.num_tokens:
            raise KVShapeError(f"tokens {start}..{start + n} fall outside a target of {self.num_tokens} tokens")
        self._copy_native(start, n, src)

    def _copy_native(self, start: int, n: int, src: NativeKV) -> None:
        raise InvalidArgumentError(f"{type(self).__name__} takes no native chunks")

    def write(self, start: int, src: torch.Tensor) -> None:
        n = src.shape[2]
        if start < 0 or start + n > self.num_tokens:
            raise KVShapeError(f"tokens {start}..{start + n} fall outside a target of {self.num_tokens} tokens")
        if self.device.type == "cuda":
            self._write_cuda(start, src)
        else:
            self._copy(start, src if src.device == self.device else src.to(self.device))

    # -- CUDA path (tests marked gpu; runs only where a device exists) --------------------------

    _stream: torch.cuda.Stream | None = None
    _lock = threading.Lock()

    def _write_cuda(self, start: int, src: torch.Tensor) -> None:  # pragma: no cover - needs a GPU
        import torch

        with self._lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.device)
                self.events: list[torch.cuda.Event] = []
                self._staged: list[tuple[torch.cuda.Event, torch.Tensor]] = []
        staged = src
        if src.device.type == "cpu" and not src.is_pinned():
            staged = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            staged.copy_(src)  # the source view dies with the read transaction: stage it now
        with torch.cuda.stream(self._stream):
            self._copy(start, staged.to(self.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self._stream)
        with self._lock:
            self.events.append(event)
            # pinned staging must live until its copy ran; release the ones already done
            self._staged = [(e, t) for e, t in self._staged if not e.query()] + [(event, staged)]

    def synchronize(self) -> None:
        """Wait until every chunk written so far is in place (a no-op on CPU)."""
        if self._stream is not None:  # pragma: no cover - needs a GPU
            self._stream.synchronize()
            self._staged = []


class GuardedTarget(KVTarget):
    """A target in memory the engine takes back when a call ends: a load that timed out hands its
    pages or blocks back at once, while reads may still be running. After `close()` returns
    nothing writes into it any more. Subclasses copy a chunk into place in `_place`, which says
    what to record as written in full (`done`)."""

    def __init__(self) -> None:
        self.done: set[int] = set()
        self._guard = threading.Condition()
        self._active = 0
        self._closed = False

    @abstractmethod
    def _place(self, start: int, src: torch.Tensor) -> int:
        """Copy `src` into place; what `done` records for it."""

    def _place_native(self, start: int, n: int, src: NativeKV) -> int:
        """Copy the first `n` tokens of `src` (in `native_layout`) into place; what `done` records."""
        raise InvalidArgumentError(f"{type(self).__name__} takes no native chunks")

    def _copy(self, start: int, src: torch.Tensor) -> None:
        self._guarded(lambda: self._place(start, src))

    def _copy_native(self, start: int, n: int, src: NativeKV) -> None:
        self._guarded(lambda: self._place_native(start, n, src))

    def _guarded(self, place: Callable[[], int]) -> None:
        with self._guard:
            if self._closed:
                return  # not an error: raising would make the transfer drop a good chunk as corrupt
            self._active += 1
        placed: int | None = None
        try:
            placed = place()
        finally:
            with self._guard:
                self._active -= 1
                if placed is not None:
                    self.done.add(placed)
                self._guard.notify_all()

    def run_guarded(self, copy: Callable[[], None]) -> bool:
        """Run a copy into this target's memory that is not a chunk (a hybrid model's state), unless the
        target is closed; whether it ran."""
        with self._guard:
            if self._closed:
                return False
            self._active += 1
        try:
            copy()
        finally:
            with self._guard:
                self._active -= 1
                self._guard.notify_all()
        return True

    def close(self) -> set[int]:
        """Refuse further copies, wait for those under way; what was written in full."""
        with self._guard:
            self._closed = True
            self._guard.wait_for(lambda: self._active == 0)
            return set(self.done)


class TensorTarget(KVTarget):
    """A canonical KV tensor `[layers, planes, tokens, heads, dim]` on any device."""

    def __init__(self, tensor: torch.Tensor, spec: ModelSpec) -> None:
        self.tensor = spec.check_kv(tensor, tensor.shape[2] if tensor.dim() == 5 else None)
        self.num_tokens = tensor.shape[2]
        self.device = tensor.device

    def _copy(self, start: int, src: torch.Tensor) -> None:
        self.tensor[:, :, start : start + src.shape[2]].copy_(src)


class PagedTarget(KVTarget):
    """An engine-style paged pool `[layers, planes, num_slots, heads, dim]` plus one slot per token.

    Token `t` of the restored sequence lands in slot `slots[t]` (any order, as a page allocator
    hands them out); each chunk is one `index_copy_` along the slot dimension.
    """

    def __init__(self, pool: torch.Tensor, slots: torch.Tensor | list[int], spec: ModelSpec) -> None:
        import torch

        if not isinstance(pool, torch.Tensor) or pool.dim() != 5:
            raise KVShapeError("pool must be a 5-dim tensor [layers, planes, num_slots, heads, dim]")
        spec.check_kv(pool, pool.shape[2])
        slots = torch.as_tensor(slots, dtype=torch.long)
        if slots.dim() != 1:
            raise KVShapeError("slots must be a 1-dim list of slot indices, one per token")
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= pool.shape[2]):
            raise KVShapeError(f"slot indices must lie in [0, {pool.shape[2]})")
        if torch.unique(slots).numel() != slots.numel():
            raise KVShapeError("slot indices must be distinct")
        self.pool = pool
        self.slots = slots.to(pool.device)
        self.num_tokens = slots.numel()
        self.device = pool.device

    def _copy(self, start: int, src: torch.Tensor) -> None:
        self.pool.index_copy_(2, self.slots[start : start + src.shape[2]], src)

    def gather(self, num_tokens: int | None = None) -> torch.Tensor:
        """The canonical KV of the first `num_tokens` tokens, read back out of the pool (for checks)."""
        n = self.num_tokens if num_tokens is None else num_tokens
        return self.pool.index_select(2, self.slots[:n])
