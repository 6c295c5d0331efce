"""FileBackend on real files: bytes, atomicity, naming, capacity and concurrency."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
from pathlib import Path

import pytest
from agentstate.backends.file import FileBackend

from agentstate.errors import InvalidArgumentError

SIZES = [1, 4095, 4096, 4097, (1 << 20) + 3]
ODD_KEYS = [
    "c/" + "ab" * 16 + "/" + "cd" * 32,
    "t/fp/Tenant.A/sess:1@host/7",
    "../../etc/passwd",
    "/abs/path",
    ".",
    "..",
    "a%2fb",
    "UPPER/lower",
    "ünï/cødé ☃",
    "t/fp/" + "T" * 128 + "/" + "s.:@" * 32 + "/12",  # too long for one file name: the trailer form
]


def all_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


async def listed(b: FileBackend, prefix: str | None = None) -> list[str]:
    return sorted([k async for k in b.keys(prefix)])


def disk_bytes(root: Path) -> int:
    """Bytes of every file under root, temp files included; tolerates files unlinked mid-walk."""
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total


def aligned_view(n: int, offset: int = 0) -> memoryview:
    """A writable view whose start is `offset` bytes past a page boundary."""
    return memoryview(mmap.mmap(-1, n + offset + 4096))[offset : offset + n]


@pytest.mark.parametrize("o_direct", [False, True])
async def test_round_trip_of_odd_sizes_is_bit_exact(tmp_path: Path, o_direct: bool) -> None:
    b = FileBackend(tmp_path / "f", o_direct=o_direct)
    keys = [f"c/{n}" for n in SIZES]
    vals = [os.urandom(n) for n in SIZES]
    await b.put(keys, vals)
    seen: dict[int, bytes] = {}
    assert await b.read(keys, lambda i, v: seen.__setitem__(i, bytes(v))) == [True] * len(keys)
    assert [seen[i] for i in range(len(keys))] == vals
    for offset in (0, 1, 512):  # page-aligned caller memory takes the direct path, the rest a bounce
        bufs = [aligned_view(n + 100, offset) for n in SIZES]
        assert await b.get_into(keys, bufs) == SIZES
        assert [bytes(buf[:n]) for buf, n in zip(bufs, SIZES)] == vals
        assert all(bytes(buf[n:]) == bytes(100) for buf, n in zip(bufs, SIZES))  # nothing past the value
    assert (await b.stats()).errors == 0
    await b.close()


async def test_direct_reads_fall_back_when_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import agentstate.backends.file as mod

    real_open = os.open

    def refusing_open(path: str, flags: int, *args: int) -> int:
        if mod._O_DIRECT and flags & mod._O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    b = FileBackend(tmp_path / "f", o_direct=True)
    val = os.urandom(10_001)
    await b.put(["c/a"], [val])
    monkeypatch.setattr(mod.os, "open", refusing_open)
    buf = memoryview(bytearray(20_000))
    assert await b.get_into(["c/a"], [buf]) == [10_001] and bytes(buf[:10_001]) == val
    assert not b._direct  # refused once, buffered from then on
    await b.close()


@pytest.mark.parametrize("o_direct", [False, True])
async def test_buffered_batches_are_announced_and_advice_never_fails_a_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, o_direct: bool
) -> None:
    """Buffered reads announce their files (WILLNEED: the disk gets the batch in flight); O_DIRECT
    reads never do (it would only fill the page cache); a refused advice is no error."""
    import agentstate.backends.file as mod

    b = FileBackend(tmp_path / "f", o_direct=o_direct)
    keys = [f"c/{i}" for i in range(5)]
    vals = [os.urandom(9000 + i) for i in range(5)]
    await b.put(keys, vals)
    advised: list[int] = []

    def refusing_fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == mod._FADV_WILLNEED:
            advised.append(os.fstat(fd).st_size)
            raise OSError(22, "advice refused")

    monkeypatch.setattr(mod.os, "posix_fadvise", refusing_fadvise)
    for _ in range(3):
        bufs = [memoryview(bytearray(10_000)) for _ in keys]
        assert await b.get_into(keys, bufs) == [len(v) for v in vals]
        seen: dict[int, bytes] = {}
        sink = seen.__setitem__
        assert await b.read(keys + ["c/none"], lambda i, v, sink=sink: sink(i, bytes(v))) == [True] * 5 + [False]
        await asyncio.gather(*list(b._announcing))
        assert [bytes(buf[: len(v)]) for buf, v in zip(bufs, vals)] == vals and [seen[i] for i in range(5)] == vals
    # A file a reader already started is not advised, so a fast reader may leave none: only sizes of ours.
    assert set(advised) <= {len(v) for v in vals}
    if o_direct and b._direct:  # O_DIRECT held (a filesystem that refuses it reads buffered, announced)
        assert advised == []
    assert (await b.stats()).errors == 0
    await b.close()


def test_read_ahead_window_skips_files_in_reading_and_frees_what_never_gets_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The announcer advises each file once, never one a reader is on, and a full window (bytes
    announced whose read never started) frees itself after _EXPIRE instead of stalling advice."""
    import agentstate.backends.file as mod

    paths = []
    for i in range(4):
        (p := tmp_path / f"v{i}").write_bytes(b"x" * (1000 + i))
        paths.append(str(p))
    advised: list[str] = []
    real = os.posix_fadvise
    monkeypatch.setattr(
        mod.os,
        "posix_fadvise",
        lambda fd, o, n, a: advised.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd, o, n, a),
    )
    monkeypatch.setattr(mod._ReadAhead, "_EXPIRE", 0.01)
    ahead = mod._ReadAhead(window=1)  # room for one announcement at a time
    ahead.reading(paths[0])
    ahead.announce(paths[1:2] + paths)  # v1 twice (once advised); v0 is being read; v2, v3 wait for v1, v2 to expire
    ahead.consumed(paths[0])
    assert advised == paths[1:]
    ahead.consumed(paths[1])  # a read of an announced file frees its place
    ahead.announce(paths[:1])
    assert advised == [*paths[1:], paths[0]]


def test_thread_counts_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError):
        FileBackend(tmp_path / "f", read_threads=0)


async def test_reused_read_buffers_hand_each_sink_call_the_right_bytes(tmp_path: Path) -> None:
    """Read buffers are recycled (a view is valid only during its sink call): every call must
    still see exactly its own file, across sizes that share a buffer and ones that do not."""
    b = FileBackend(tmp_path / "f", threads=2)
    vals = [os.urandom((3 << 20) + (i % 3) * 4096 + i) for i in range(12)]
    keys = [f"c/{i}" for i in range(12)]
    await b.put(keys, vals)
    seen: dict[int, bytes] = {}
    for _ in range(3):
        seen.clear()
        assert all(await b.read(keys, lambda i, view: seen.__setitem__(i, bytes(view))))
        assert [seen[i] for i in range(12)] == vals
    await b.close()


async def test_writes_are_atomic_and_crash_leftovers_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "f"
    b = FileBackend(root)
    await b.put(["c/a", "t/b"], [b"alpha", b"beta"])
    assert not [p for p in all_files(root) if p.name.startswith(".tmp-")]
    leaf = next(p.parent for p in all_files(root))
    (leaf / ".tmp-deadbeef").write_bytes(b"half a chunk")  # a crash between write and rename
    assert await listed(b) == ["c/a", "t/b"]
    await b.close()
    b = FileBackend(root)
    assert not (leaf / ".tmp-deadbeef").exists()
    assert (await b.stats()).bytes_used == 9
    await b.close()


async def test_data_survives_close_and_reopen(tmp_path: Path) -> None:
    b = FileBackend(tmp_path / "f")
    vals = {k: os.urandom(1000 + i) for i, k in enumerate(ODD_KEYS)}
    await b.put(list(vals), list(vals.values()))
    await b.close()
    b = FileBackend(tmp_path / "f")
    stats = await b.stats()
    assert stats.items == len(vals) and stats.bytes_used == sum(p.stat().st_size for p in all_files(tmp_path / "f"))
    assert await b.exists(list(vals)) == [True] * len(vals)
    bufs = [memoryview(bytearray(2000)) for _ in vals]
    assert await b.get_into(list(vals), bufs) == [len(v) for v in vals.values()]
    assert [bytes(buf[: len(v)]) for buf, v in zip(bufs, vals.values())] == list(vals.values())
    await b.close()


async def test_odd_keys_round_trip_and_stay_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "deep" / "f"
    b = FileBackend(root)
    await b.put(ODD_KEYS, [k.encode() for k in ODD_KEYS])
    assert await listed(b) == sorted(ODD_KEYS)
    assert await listed(b, "t/fp/") == sorted(k for k in ODD_KEYS if k.startswith("t/fp/"))
    assert [p for p in tmp_path.rglob("*") if p.is_file() and root not in p.parents] == []
    assert all(len(p.name) <= 255 and len(p.relative_to(root).parts) == 3 for p in all_files(root))
    (root / "stray.txt").write_bytes(b"not ours")  # foreign files are never listed
    assert len(await listed(b)) == len(ODD_KEYS)
    await b.delete(ODD_KEYS + ["c/never-written"])
    assert await listed(b) == [] and (await b.stats()).bytes_used == 0
    await b.close()


async def test_stores_bytes_only_eviction_is_the_chunk_layers(tmp_path: Path) -> None:
    """No capacity, no LRU, no pins here (issue 26): the chunk layer evicts, through `delete`
    (tests/test_eviction.py: its capacity, order and the disk never passing it)."""
    root = tmp_path / "f"
    b = FileBackend(root)
    await b.put(["a", "b", "c"], [b"1" * 3000, b"2" * 3000, b"3" * 3000])
    stats = await b.stats()
    assert (stats.bytes_used, stats.items, stats.capacity_bytes, stats.evictions) == (9000, 3, None, 0)
    assert stats.bytes_used == sum(p.stat().st_size for p in all_files(root))
    await b.close()
    b = FileBackend(root)  # reopened: the scan finds all of it
    assert await b.exists(["a", "b", "c"]) == [True] * 3 and (await b.stats()).bytes_used == 9000
    await b.close()


@pytest.mark.parametrize("o_direct", [False, True])
async def test_concurrent_puts_and_reads_of_200_keys(tmp_path: Path, o_direct: bool) -> None:
    b = FileBackend(tmp_path / "f", threads=16, o_direct=o_direct)
    data = {f"c/{i:04d}": os.urandom(5000 + i) for i in range(200)}
    await asyncio.gather(*(b.put([k], [v]) for k, v in data.items()), b.put(list(data)[:50], list(data.values())[:50]))
    bufs = {k: memoryview(bytearray(6000)) for k in data}
    got = await asyncio.gather(*(b.get_into([k], [bufs[k]]) for k in data))
    assert got == [[len(v)] for v in data.values()]
    assert all(bytes(bufs[k][: len(v)]) == v for k, v in data.items())
    seen: dict[int, bytes] = {}
    keys = list(data)
    assert all(await b.read(keys, lambda i, v: seen.__setitem__(i, bytes(v))))
    assert [seen[i] for i in range(200)] == list(data.values())
    stats = await b.stats()
    assert stats.items == 200 and stats.writes == 200 and stats.errors == 0
    await b.close()


def test_aligned_view_helper_is_page_aligned() -> None:
    view = aligned_view(10)
    assert ctypes.addressof(ctypes.c_char.from_buffer(view)) % 4096 == 0


async def test_cancelled_puts_and_racing_deletes_keep_accounting_equal_to_the_disk(tmp_path: Path) -> None:
    root = tmp_path / "f"
    b = FileBackend(root)
    task = asyncio.ensure_future(b.put([f"c/big{i}" for i in range(8)], [os.urandom(2 << 20) for _ in range(8)]))
    await asyncio.sleep(0.01)
    task.cancel()
    ops = [b.put(["c/x"], [b"1" * 5000]), b.delete(["c/x"]), b.put(["c/x"], [b"1" * 5000]), b.delete(["c/x", "c/y"])]
    await asyncio.gather(*ops)
    assert await b.exists(["c/x"]) == [False]
    await b.close()  # waits for the shielded writes of the cancelled put
    assert (await b.stats()).bytes_used == disk_bytes(root)
    b = FileBackend(root)
    assert (await b.stats()).bytes_used == disk_bytes(root)
    await b.close()
