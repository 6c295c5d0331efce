from __future__ import annotations

import gc

import torch

from agentstate.memory import HUGE_PAGE, BufferPool, copy_bytes, host_buffer


def test_pool_recycles_a_buffer_only_after_every_view_is_gone() -> None:
    pool = BufferPool(max_bytes=64 << 20)
    a = pool.tensor((4, HUGE_PAGE), torch.uint8)
    a.fill_(7)
    view = a[1:2]  # a slice keeps the storage alive after the base tensor is dropped
    del a
    gc.collect()
    b = pool.tensor((4, HUGE_PAGE), torch.uint8)
    assert pool.reused == 0  # the slice still owned the memory, so b got a fresh buffer
    b.fill_(1)
    assert int(view.min()) == int(view.max()) == 7  # and the slice's bytes are untouched
    del view
    gc.collect()
    c = pool.tensor((4, HUGE_PAGE), torch.uint8)
    assert pool.reused == 1
    c.fill_(3)
    assert int(b.min()) == 1


def test_pool_keeps_at_most_max_bytes_and_small_requests_bypass_it() -> None:
    pool = BufferPool(max_bytes=HUGE_PAGE)
    tensors = [pool.tensor((HUGE_PAGE,), torch.uint8) for _ in range(3)]
    del tensors
    gc.collect()
    assert pool._held == HUGE_PAGE
    small = pool.tensor((16,), torch.bfloat16)
    assert small.shape == (16,) and small.dtype == torch.bfloat16
    pool.clear()


def test_host_buffers_are_exact_size_and_copy_bytes_copies() -> None:
    assert len(host_buffer(10)) == 10 and len(host_buffer(HUGE_PAGE + 3)) == HUGE_PAGE + 3
    src = memoryview(bytes(range(256)) * 9000)
    out = copy_bytes(src)
    assert bytes(out) == bytes(src)
