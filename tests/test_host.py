from __future__ import annotations

import pytest
from agentstate.backends.host import HostBackend

from agentstate.errors import CapacityError


async def test_lru_eviction_never_exceeds_capacity_and_reports_victims() -> None:
    evicted: list[str] = []
    host = HostBackend(10_000, on_evict=evicted.extend)
    await host.put(["a", "b", "c"], [b"1" * 3000, b"2" * 3000, b"3" * 3000])
    await host.exists(["a"])
    await host.get_into(["a"], [memoryview(bytearray(3000))])  # a is now most recent
    await host.put(["d"], [b"4" * 3000])
    assert evicted == ["b"]
    assert await host.exists(["a", "b", "c", "d"]) == [True, False, True, True]
    assert (await host.stats()).bytes_used == 9000 <= host.capacity_bytes
    await host.close()


async def test_pinned_entries_survive_and_full_pinned_tier_raises() -> None:
    host = HostBackend(6000)
    await host.put(["a", "b"], [b"1" * 3000, b"2" * 3000])
    host.pin(["a", "b"])
    with pytest.raises(CapacityError):
        await host.put(["c"], [b"3" * 3000])
    assert await host.exists(["a", "b", "c"]) == [True, True, False]
    host.unpin(["a"])
    await host.put(["c"], [b"3" * 3000])
    assert await host.exists(["a", "b", "c"]) == [False, True, True]
    with pytest.raises(CapacityError):
        await host.put(["huge"], [b"x" * 7000])
    await host.close()


async def test_put_keeps_the_callers_object_without_copying() -> None:
    host = HostBackend(1 << 20)
    value = bytearray(b"abc" * 100)
    await host.put(["k"], [value])
    seen = []
    await host.read(["k"], lambda i, v: seen.append(v.obj))
    assert seen[0] is value
    await host.close()
