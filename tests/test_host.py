from __future__ import annotations

from agentstate.backends.host import HostBackend


async def test_stores_bytes_only_eviction_is_the_chunk_layers() -> None:
    """No capacity, no LRU, no pins here (issue 26): the chunk layer decides what leaves, and tells
    the index (tests/test_eviction.py); the backend keeps whatever it is given until it is deleted."""
    host = HostBackend()
    await host.put(["a", "b", "c"], [b"1" * 3000, b"2" * 3000, b"3" * 3000])
    await host.put(["a"], [b"x" * 10])  # values are immutable: the first copy stands
    assert await host.exists(["a", "b", "c", "d"]) == [True, True, True, False]
    stats = await host.stats()
    assert (stats.bytes_used, stats.items, stats.capacity_bytes, stats.evictions) == (9000, 3, None, 0)
    await host.delete(["b"])
    assert await host.exists(["a", "b"]) == [True, False] and (await host.stats()).bytes_used == 6000
    await host.close()


async def test_put_keeps_the_callers_object_without_copying() -> None:
    host = HostBackend()
    value = bytearray(b"abc" * 100)
    await host.put(["k"], [value])
    seen = []
    await host.read(["k"], lambda i, v: seen.append(v.obj))
    assert seen[0] is value
    await host.close()
