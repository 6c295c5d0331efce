"""Compressed tiers (agentstate.compress, backends/compressed.py): lossless modes are bit-exact for
every dtype and odd shape over real host, LMDB, file and Redis backends; fp8 serves the dequantized
KV within its stated bound, re-encoded so the codec checksum holds; damaged, truncated, misbound and
bomb frames are misses that leave what is stored untouched; missing coders are MissingDependencyError.
Stores with compressed tiers: tests/test_compression_store.py.

KV comes from tiny Qwen2-shaped models built from a config with random weights (nothing downloaded).
"""

from __future__ import annotations

import functools
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from agentstate.backends.compressed import CompressedBackend
from agentstate.backends.file import FileBackend
from agentstate.backends.host import HostBackend
from agentstate.backends.lmdb import LMDBBackend
from pydantic import ValidationError
from transformers import Qwen2Config, Qwen2ForCausalLM

from agentstate import ModelSpec, codec, compress
from agentstate.config import TierConfig
from agentstate.errors import AgentStateError, CorruptDataError, MissingDependencyError
from tests.conftest import bits_equal, random_kv

FP = "0f" * 16
LOSSLESS = ["zstd", "lz4"]


def model(dtype: torch.dtype = torch.bfloat16, layers: int = 3) -> Any:
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024,
                      tie_word_embeddings=False)  # fmt: skip
    return Qwen2ForCausalLM(cfg).to(dtype).eval()


@torch.no_grad()
def model_kv(m: Any, tokens: int, seed: int = 0) -> tuple[torch.Tensor, Any]:
    """Token ids and the DynamicCache a real forward pass computed for them."""
    ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(seed))
    return ids, m(input_ids=ids, use_cache=True).cache


def canonical(cache: Any) -> torch.Tensor:
    """[layers, 2, tokens, heads, dim] from a DynamicCache of batch 1."""
    return torch.stack([torch.stack([l.keys[0], l.values[0]]) for l in cache.layers]).transpose(2, 3).contiguous()


def backends(tmp: Path) -> dict[str, Callable[[], Any]]:
    return {
        "host": lambda: HostBackend(),
        "lmdb": lambda: LMDBBackend(tmp / "lmdb", map_size=64 << 20),
        "file": lambda: FileBackend(tmp / "file", sync=False),
    }


async def read_all(backend: Any, keys: list[str]) -> tuple[list[bool], dict[int, bytes]]:
    got: dict[int, bytes] = {}
    found = await backend.read(keys, lambda i, view: got.__setitem__(i, bytes(view)))
    return found, got


@pytest.mark.parametrize("method", LOSSLESS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
async def test_lossless_round_trips_are_bit_exact(tmp_path: Path, method: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    values = {  # model-like values, arbitrary bit patterns (NaN, inf), odd sizes, one token, not a chunk at all
        "c/smooth": codec.encode((torch.randn(3, 2, 37, 3, 17, generator=g) * 4).to(dtype), FP, key="c/smooth"),
        "c/bits": codec.encode(random_kv(ModelSpec(model_id="t/x", num_layers=2, num_kv_heads=3, head_dim=5,
                                                   dtype=str(dtype).split(".")[1]), 11), FP, key="c/bits"),  # fmt: skip
        "c/one": codec.encode(torch.full((1, 1, 1, 1, 1), 1.5, dtype=dtype), FP, key="c/one"),
        "t/odd": b"\x01\x02" * 1001 + b"\x03",
    }
    keys = list(values)
    for kind, make in backends(tmp_path / method / str(dtype)).items():
        backend = CompressedBackend(make(), method, threads=2)
        try:
            await backend.put(keys, list(values.values()))
            found, got = await read_all(backend, keys)
            assert found == [True] * len(keys), kind
            assert all(got[i] == bytes(values[k]) for i, k in enumerate(keys)), kind
            bufs = [memoryview(bytearray(len(values[k]) + 7)) for k in keys]
            assert await backend.get_into(keys, bufs) == [len(values[k]) for k in keys]
            assert all(bytes(b[: len(values[k])]) == bytes(values[k]) for b, k in zip(bufs, keys))
            small = [memoryview(bytearray(10)) for _ in keys]
            assert await backend.get_into(keys, small) == [0] * len(keys)  # does not fit: a miss, as uncompressed
            decoded = codec.decode(got[0], key="c/smooth", fingerprint=FP, dtype=dtype)  # the codec checksum holds
            assert bits_equal(decoded, codec.decode(values["c/smooth"], key="c/smooth", fingerprint=FP, dtype=dtype))
            stored = await backend.sizes(keys)  # compressed sizes (LMDB counts its pages in stats instead)
            assert kind == "lmdb" or (await backend.stats()).bytes_used == sum(stored)
            _, raw = await read_all(backend.inner, keys)
            assert compress.is_frame(memoryview(raw[3])) and stored[3] < len(values["t/odd"])
            if stored[0] < len(values["c/smooth"]):  # zstd always here; lz4 finds no runs in random fp16 planes
                assert compress.is_frame(memoryview(raw[0]))
            else:
                assert raw[0] == bytes(values["c/smooth"]) and method == "lz4"  # stored as it is
        finally:
            await backend.close()


async def test_fp8_serves_the_dequantized_kv_within_its_bound(tmp_path: Path) -> None:
    """Bound per element: e4m3 keeps 3 mantissa bits (round to nearest: 2^-4 relative), below 2^-6 of
    the scale its steps are 2^-9 of it; the result is rounded to bf16 once more (2^-8 relative)."""
    _, cache = model_kv(model(), 300)
    kv = canonical(cache)[:, :, :256]
    value = codec.encode(kv, FP, key="c/k")
    amax = kv.float().abs().amax(dim=(2, 4))[:, :, None, :, None]
    for method in ("fp8", "fp8+zstd"):
        backend = CompressedBackend(LMDBBackend(tmp_path / method, map_size=64 << 20), method, threads=2)
        try:
            await backend.put(["c/k"], [value])
            assert (await backend.sizes(["c/k"]))[0] < 0.55 * len(value)
            (found, got) = await read_all(backend, ["c/k"])
            served = codec.decode(got[0], key="c/k", fingerprint=FP, dtype=torch.bfloat16, shape=tuple(kv.shape))
            err = (served.float() - kv.float()).abs()
            bound = (2**-4 + 2**-8 + 2**-12) * kv.float().abs() + amax / compress.FP8_MAX * 2**-9
            assert bool((err <= bound).all()) and float(err.max()) > 0  # lossy, and bounded
            assert float(err.mean()) < 0.04 * float(kv.float().abs().mean())  # measured ~0.022 here
            _, raw = await read_all(backend.inner, ["c/k"])
            moved = await read_all_under(backend, raw[0], "c/other")
            assert moved == [False]  # the frame is bound to its key: never re-encoded under another
        finally:
            await backend.close()
    # a chunk fp8 cannot hold (inf) is stored lossless, bit-exact
    bad = kv.clone()
    bad[0, 0, 0, 0, 0] = float("inf")
    frame = compress.compress(codec.encode(bad, FP, key="c/i"), "c/i", "fp8+zstd")
    assert bits_equal(codec.decode(compress.decompress(frame, "c/i"), key="c/i", fingerprint=FP, dtype=bad.dtype), bad)


async def read_all_under(backend: CompressedBackend, frame: bytes, key: str) -> list[bool]:
    """Store `frame` under `key` and read it back: which reads came back as a chunk valid under `key`
    (a frame that fails its own check is handed on undecoded, for the chunk check to reject)."""
    await backend.inner.put([key], [frame])
    found, got = await read_all(backend, [key])
    valid = []
    for hit, value in zip(found, [got.get(0)]):
        try:
            codec.decode(memoryview(value), key=key, fingerprint=FP, dtype=torch.bfloat16) if hit else None
        except AgentStateError:
            hit = False
        valid.append(bool(hit))
    return valid


@functools.cache
def _bombs() -> tuple[bytes, bytes, bytes]:
    import lz4.block
    import zstandard

    zeros = b"\0" * (64 << 20)
    unsized = zstandard.ZstdCompressor(write_content_size=False)
    return zstandard.ZstdCompressor().compress(zeros), unsized.compress(zeros), lz4.block.compress(zeros, store_size=False)


def frames(key: str) -> dict[str, bytes]:
    """Damaged and hostile frames for `key` (checksums made valid where an attacker could: xxh3 is no MAC)."""
    import xxhash

    value = codec.encode(torch.randn(2, 2, 64, 2, 16).to(torch.bfloat16), FP, key=key)
    good = compress.compress(value, key, "zstd")
    assert compress.is_frame(good)

    def forge(quant: int, coder: int, elem: int, original: int, stage: int, payload: bytes) -> bytes:
        fields = compress._FIELDS.pack(compress.MAGIC, 1, quant, coder, elem, original, stage, len(payload))
        seed = xxhash.xxh3_64(fields)
        seed.update(key.encode())
        return fields + compress._SUM.pack(xxhash.xxh3_64_intdigest(payload, seed=seed.intdigest())) + payload

    zstd_bomb, zstd_bomb_unsized, lz4_bomb = _bombs()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x40
    return {
        "truncated": good[:-5],
        "header only": good[: compress.HEADER_SIZE - 3],
        "bit flip": bytes(flipped),
        "zstd bomb": forge(0, 1, 2, 4096, 4096, zstd_bomb),
        "zstd bomb, no size": forge(0, 1, 2, 4096, 4096, zstd_bomb_unsized),
        "lz4 bomb": forge(0, 2, 2, 4096, 4096, lz4_bomb),
        "huge declared": forge(0, 1, 2, 1 << 40, 1 << 40, b"x" * 100),
        "garbage payload": forge(0, 1, 2, 4096, 4096, b"\x28\xb5\x2f\xfd" + b"\xff" * 200),
        "fp8 wrong shape": forge(1, 0, 1, len(value), 300, bytes(16) + b"\x03" + struct.pack("<5I", 2, 2, 64, 2, 16)
                                 + bytes(263)),  # fmt: skip
        "fp8 bad dtype": forge(1, 0, 1, 400, 300, bytes(16) + b"\x07" + bytes(283)),
    }


async def test_damaged_and_hostile_frames_are_misses_and_leave_stored_data_intact(tmp_path: Path) -> None:
    bad = frames("c/k")
    _bombs()
    tracemalloc.start()
    for name, frame in bad.items():
        with pytest.raises(CorruptDataError):
            compress.decompress(frame, "c/k")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20, f"decoding bombs allocated {peak} bytes"  # 64 MiB bombs never expanded
    with pytest.raises(CorruptDataError):  # a valid frame read under another key
        compress.decompress(compress.compress(bytes(2000), "c/k", "zstd"), "c/j")

    good_value = codec.encode(torch.ones(2, 2, 64, 2, 16, dtype=torch.bfloat16), FP, key="c/good")
    backend = CompressedBackend(LMDBBackend(tmp_path / "lmdb", map_size=256 << 20), "zstd", threads=2)
    try:
        keys = [f"c/{i}" for i in range(len(bad))]
        stored = [frames(k)[name] for k, name in zip(keys, bad)]  # each bound to the key it is stored under
        await backend.put(["c/good"], [good_value])
        await backend.inner.put(keys, stored)
        found, got = await read_all(backend, ["c/good", *keys])
        assert found == [True] * (1 + len(keys)) and got[0] == bytes(good_value)
        for i, frame in enumerate(stored):  # handed on undecoded, for the chunk check to reject
            assert got[i + 1] == frame
            with pytest.raises(AgentStateError):
                codec.decode(memoryview(frame), key=keys[i], fingerprint=FP, dtype=torch.bfloat16)
        assert await backend.get_into(keys, [memoryview(bytearray(1 << 15)) for _ in keys]) == [0] * len(keys)
        assert (await backend.stats()).errors == 2 * len(keys)
        _, raw = await read_all(backend.inner, keys)  # the stored bytes are untouched by the failed decodes
        assert [raw[i] for i in range(len(keys))] == stored
    finally:
        await backend.close()


def test_missing_coder_is_a_missing_dependency_error_and_import_agentstate_needs_neither(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "lz4.block", None)
    with pytest.raises(MissingDependencyError) as caught:
        compress.require("lz4")
    assert caught.value.extra == "compress" and "agentstate-kv[compress]" in str(caught.value)
    with pytest.raises(MissingDependencyError):
        CompressedBackend(HostBackend(), "lz4")
    code = ("import sys, agentstate, agentstate.store, agentstate.chunks.registry, agentstate.compress;"
            " print(sorted(m for m in sys.modules if m.split('.')[0] in ('zstandard', 'lz4')))")  # fmt: skip
    root = Path(__file__).parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "[]"


def test_config_defaults_to_none_and_refuses_a_compressed_device_tier() -> None:
    assert TierConfig(kind="lmdb").compression == "none" and TierConfig(kind="redis").compression == "none"
    with pytest.raises(ValidationError):
        TierConfig(kind="device", compression="zstd")
    with pytest.raises(ValidationError):
        TierConfig(kind="host", compression="gzip")  # type: ignore[arg-type]


async def test_compressed_redis_tier_round_trips(redis_server: Any) -> None:
    from agentstate.chunks.registry import build_backend
    from agentstate.config import StoreConfig

    cfg = TierConfig(kind="redis", url=redis_server.url, prefix="compress-test:", compression="lz4")
    backend = build_backend(cfg, StoreConfig())
    assert isinstance(backend, CompressedBackend) and backend.remote and backend.name == "redis"
    _, cache = model_kv(model(), 64)
    values = {f"c/r{i}": codec.encode(canonical(cache) + i, FP, key=f"c/r{i}") for i in range(3)}
    try:
        await backend.put(list(values), list(values.values()))
        found, got = await read_all(backend, [*values, "c/none"])
        assert found == [True, True, True, False] and [got[i] for i in range(3)] == [bytes(v) for v in values.values()]
        bufs = [memoryview(bytearray(len(v))) for v in values.values()]
        assert await backend.get_into(list(values), bufs) == [len(v) for v in values.values()]
        assert [bytes(b) for b in bufs] == [bytes(v) for v in values.values()]
    finally:
        await backend.delete(list(values))
        await backend.close()
