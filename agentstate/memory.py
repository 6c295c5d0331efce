"""Host buffers backed by transparent huge pages.

On these machines a first touch of fresh 4 KiB pages runs at 1-2.5 GB/s, slower than the copy
that fills them; 2 MiB pages make it several times cheaper. Large buffers are therefore anonymous
mmaps advised MADV_HUGEPAGE (a no-op where THP is off). Small ones stay plain bytearrays.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
import weakref
from typing import TYPE_CHECKING, Union

import numpy as np

if TYPE_CHECKING:
    import torch

Buffer = Union[bytearray, mmap.mmap]
"""A writable host buffer, as host tiers keep values."""
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def host_buffer(nbytes: int) -> bytearray | mmap.mmap:
    """A writable, zeroed buffer of exactly `nbytes` (huge-page backed when large)."""
    if nbytes < HUGE_PAGE or _MADV_HUGEPAGE is None:
        return bytearray(nbytes)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(_MADV_HUGEPAGE)
    except OSError:
        pass  # THP unavailable: still a correct buffer, just 4 KiB pages
    return buf


def empty_host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty` on a huge-page host buffer (the tensor keeps the buffer alive)."""
    import torch

    numel = 1
    for dim in shape:
        numel *= dim
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(host_buffer(numel * dtype.itemsize), dtype=dtype).view(shape)


def copy_bytes(view: memoryview, out: Buffer | None = None) -> Buffer:
    """An owned copy of `view` in `out` (exactly as long; default a fresh host buffer), copied by
    torch, which releases the GIL."""
    import torch

    if out is None:
        out = host_buffer(len(view))
    elif len(out) != len(view):
        raise ValueError(f"a {len(out)}-byte buffer for a {len(view)}-byte copy")
    if len(view):
        torch.frombuffer(out, dtype=torch.uint8).copy_(torch.frombuffer(view, dtype=torch.uint8))
    return out


class BufferPool:
    """Recycles the huge-page buffers of restored tensors once nothing references them.

    A fresh buffer costs its first-touch page faults, which on a VM that hands freed pages back
    to the hypervisor is most of a restore's time. A tensor from `tensor()` sits on a numpy array
    over a pooled mmap; when the last view of that storage dies, a finalizer puts the mmap back
    (up to `max_bytes` kept), already touched. Buffers come back uninitialised: callers overwrite
    or zero what they hand out.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[mmap.mmap | bytearray]] = {}
        self._held = 0
        self._lock = threading.Lock()
        self.reused = 0

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        import torch

        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if nbytes < HUGE_PAGE or self.max_bytes <= 0:
            return empty_host(shape, dtype)
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        with self._lock:
            free = self._free.get(size)
            buf = free.pop() if free else None
            if buf is not None:
                self._held -= size
                self.reused += 1
        if buf is None:
            buf = host_buffer(size)
        array = np.frombuffer(buf, dtype=np.uint8, count=nbytes)
        weakref.finalize(array, self._give_back, buf, size)
        return torch.from_numpy(array).view(dtype).view(shape)

    def _give_back(self, buf: mmap.mmap | bytearray, size: int) -> None:
        with self._lock:
            if self._held + size <= self.max_bytes:
                self._free.setdefault(size, []).append(buf)
                self._held += size
        # Otherwise drop it: the array being finalised still exports the buffer, so it cannot be
        # closed here; it is unmapped when that export goes.

    def clear(self) -> None:
        with self._lock:
            for bufs in self._free.values():
                for buf in bufs:
                    if isinstance(buf, mmap.mmap):
                        with contextlib.suppress(BufferError):
                            buf.close()
            self._free.clear()
            self._held = 0
