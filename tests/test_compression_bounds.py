"""Compressed frames that declare huge decoded sizes cost at most the chunk's own size to refuse.

A frame's checksum is xxh3, no MAC: whoever can write to a shared tier can forge a valid one. Each
frame here has a valid checksum for the key it is stored under. A frame declaring 1 GiB decoded (a
32 KiB zstd payload, a 4 MiB lz4 one) is refused before its decoder runs when the key's chunk is
128 KiB; a frame whose declared size lies about its payload is refused by the decoder at the declared
size; four of them decoding at once grow the process by less than 64 MiB. Every one is a miss (the
engine recomputes), and what is stored is left as it was.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest
import torch

from agentstate import StateStore, codec, compress
from agentstate.backends.compressed import CompressedBackend
from agentstate.backends.host import HostBackend
from agentstate.config import TierConfig
from agentstate.errors import CorruptDataError
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens
from tests.test_redis_hostile import PeakRss

MiB, GiB = 1 << 20, 1 << 30
CHUNK = 64
LIMIT = codec.encoded_size(CHUNK * SPEC4.token_bytes)  # 128 KiB + the codec header: the largest valid chunk


@functools.cache
def zstd_zeros(n: int, sized: bool = True) -> bytes:
    """A zstd frame of `n` zero bytes, made a MiB at a time (never `n` bytes in memory)."""
    import zstandard

    cobj = zstandard.ZstdCompressor(level=1, write_content_size=sized).compressobj(size=n if sized else -1)
    zeros = bytes(MiB)
    return b"".join(cobj.compress(zeros) for _ in range(n // MiB)) + cobj.flush()


@functools.cache
def lz4_zeros(n: int) -> bytes:
    """An lz4 block of `n` zero bytes, written by hand: a literal zero, one match of offset 1 over all
    but the last 5 bytes (lz4 ends a block with 5 literals), then those 5 literals."""
    match = n - 1 - 5
    extra = match - 4 - 15  # match lengths past 4 + 15 continue in bytes of 255
    block = bytes([0x1F, 0x00, 0x01, 0x00]) + b"\xff" * (extra // 255) + bytes([extra % 255])
    return block + bytes([0x50]) + bytes(5)


def forge(key: str, coder: str, original: int, stage: int, payload: bytes, elem: int = 1) -> bytes:
    """A lossless frame for `key` declaring `original`/`stage` bytes, its checksum valid (xxh3 is no MAC)."""
    import xxhash

    fields = compress._FIELDS.pack(compress.MAGIC, 1, 0, compress.ENTROPY[coder], elem, original, stage, len(payload))
    seed = xxhash.xxh3_64(fields)
    seed.update(key.encode())
    return fields + compress._SUM.pack(xxhash.xxh3_64_intdigest(payload, seed=seed.intdigest())) + payload


def bomb(key: str, coder: str) -> bytes:
    """A frame declaring 1 GiB decoded whose payload really decodes to 1 GiB of zeros."""
    payload = zstd_zeros(GiB) if coder == "zstd" else lz4_zeros(GiB)
    return forge(key, coder, GiB, GiB, payload)


def test_the_forged_payloads_are_what_they_claim() -> None:
    import lz4.block
    import zstandard

    assert len(lz4.block.decompress(lz4_zeros(3 * MiB), uncompressed_size=3 * MiB)) == 3 * MiB
    assert zstandard.frame_content_size(zstd_zeros(GiB)) == GiB and len(zstd_zeros(GiB)) < 64 << 10
    assert len(lz4_zeros(GiB)) < 5 * MiB


@pytest.mark.parametrize("coder", ["zstd", "lz4"])
def test_a_frame_declaring_1_gib_is_refused_before_its_decoder_runs(coder: str) -> None:
    frame = bomb("c/k", coder)
    with PeakRss() as rss, pytest.raises(CorruptDataError, match="at most"):
        compress.decompress(frame, "c/k", limit=LIMIT)
    assert rss.growth < 64 * MiB, f"refusing a {coder} bomb grew the process by {rss.growth / MiB:.0f} MiB"


@pytest.mark.parametrize(
    "lie",
    ["zstd declares the chunk, decodes to 1 GiB", "zstd without a size, decodes to 1 GiB",
     "lz4 declares the chunk, decodes to 1 GiB", "zstd declares more than it holds"],
)  # fmt: skip
def test_a_frame_whose_declared_size_lies_is_refused_at_that_size(lie: str) -> None:
    payload = {
        "zstd declares the chunk, decodes to 1 GiB": zstd_zeros(GiB),
        "zstd without a size, decodes to 1 GiB": zstd_zeros(GiB, sized=False),
        "lz4 declares the chunk, decodes to 1 GiB": lz4_zeros(GiB),
        "zstd declares more than it holds": zstd_zeros(MiB)[: 64 << 10],  # a cut frame: its content is short
    }[lie]
    frame = forge("c/k", lie.split()[0], LIMIT, LIMIT, payload)
    with PeakRss() as rss, pytest.raises(CorruptDataError):
        compress.decompress(frame, "c/k", limit=LIMIT)
    assert rss.growth < 64 * MiB, f"{lie}: grew the process by {rss.growth / MiB:.0f} MiB"


async def test_four_bombs_decoding_at_once_are_misses_within_64_mib_and_a_good_frame_still_decodes() -> None:
    backend = CompressedBackend(HostBackend(), "zstd", threads=4)
    value = codec.encode(random_kv(SPEC4, CHUNK, seed=3), SPEC4.fingerprint, key="c/good")
    try:
        await backend.put(["c/good"], [value])
        bombs = {f"c/bomb{i}": bomb(f"c/bomb{i}", "zstd") for i in range(4)}
        await backend.inner.put(list(bombs), list(bombs.values()))
        got: dict[tuple[int, int], bytes] = {}

        async def one(j: int, keys: list[str]) -> list[bool]:
            sink = lambda i, view: got.__setitem__((j, i), bytes(view))  # noqa: E731
            return await backend.read_bounded(keys, sink, [LIMIT] * len(keys))

        with PeakRss() as rss:
            found = await asyncio.gather(*(one(j, [k]) for j, k in enumerate(bombs)), one(4, ["c/good"]))
        assert rss.growth < 64 * MiB, f"four bombs at once grew the process by {rss.growth / MiB:.0f} MiB"
        for j, key in enumerate(bombs):  # a miss: handed on undecoded, for the chunk check to refuse
            assert not found[j][0] or got[(j, 0)] == bombs[key]
        assert found[4] == [True] and got[(4, 0)] == bytes(value)  # the good one decodes bit-exact
        assert (await backend.stats()).errors == 4
        raw: dict[int, bytes] = {}
        await backend.inner.read(list(bombs), lambda i, v: raw.__setitem__(i, bytes(v)))
        assert [raw[i] for i in range(4)] == list(bombs.values())  # what is stored is untouched
    finally:
        await backend.close()


@pytest.mark.parametrize("coder", ["zstd", "lz4"])
async def test_a_resume_over_bombs_in_a_compressed_tier_is_a_miss_within_64_mib(coder: str, tmp_path: Path) -> None:
    """Through the store: every chunk of a session replaced by a 1 GiB bomb bound to its key. The
    chunk layer bounds each read by the chunk's size, so the tier refuses each frame (zstd: before
    its decoder runs; lz4: the 4 MiB frame is longer than any 128 KiB chunk's) with four decode
    threads at work; the resume restores nothing and the engine recomputes."""
    tiers = [TierConfig(kind="lmdb", compression=coder)]
    tokens, kv = random_tokens(7 * CHUNK, seed=5), random_kv(SPEC4, 7 * CHUNK, seed=5)
    opts = {"tiers": tiers, "chunk_tokens": CHUNK, "lmdb_map_size": 256 * MiB}
    async with StateStore.open(tmp_path / "data", SPEC4, **opts) as store:
        await store.snapshot("s", tokens, kv)
        keys = (await store.session("s")).chunk_keys
        assert len(keys) == 7
        tier = store.chunks.backend("lmdb")
        assert isinstance(tier, CompressedBackend)
        await tier.inner.put(keys, [bomb(k, coder) for k in keys])
    async with StateStore.open(tmp_path / "data", SPEC4, **opts) as store:
        into = torch.zeros_like(kv)
        with PeakRss() as rss:
            result = await asyncio.wait_for(store.resume("s", into), 120)  # a hang guard, not a figure
        assert rss.growth < 64 * MiB, f"a resume over {coder} bombs grew the process by {rss.growth / MiB:.0f} MiB"
        assert result.restored_tokens == 0 and result.tokens == tokens and not into.view(torch.uint8).any()
        assert (await store.session("s")).version == 1  # the session itself is as it was
        await store.snapshot("s", tokens, kv)  # the engine recomputed and stores again: whole again
    async with StateStore.open(tmp_path / "data", SPEC4, **opts) as store:
        again = await store.resume("s")
        assert again.restored_tokens == 7 * CHUNK and bits_equal(again.kv, kv)
