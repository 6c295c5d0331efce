"""Chunks kept in an engine's own block layout (agentstate.layouts): vLLM's CPU blocks, K transposed.

The native payload in these tests is built element by element from canonical KV, independently of
the code under test (`reference`), so a layout mistake in the codec, the conversion, the engine's
block copies or the store shows as unequal bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentstate import codec, compress, layouts
from agentstate.adapters.vllm.blocks import BlockLayout, EngineBlocks
from agentstate.config import StoreConfig
from agentstate.errors import AgentStateError, CorruptDataError, KVShapeError
from agentstate.layouts import NativeKV
from agentstate.spec import ModelSpec
from agentstate.store import StateStore

FP = "0" * 32
L, H, D = 3, 2, 8


def canonical(tokens: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, tokens, H, D, generator=g).to(dtype)


def reference(kv: torch.Tensor, bs: int) -> torch.Tensor:
    """vLLM's CPU block memory of canonical `kv`, one (layer, block, head) at a time:
    `[layers, blocks, heads, 2 * bs * dim]`, K transposed `[dim, bs]` then V `[bs, dim]`."""
    layers, _, tokens, heads, dim = kv.shape
    out = torch.empty(layers, tokens // bs, heads, 2 * bs * dim, dtype=kv.dtype)
    for layer in range(layers):
        for b in range(tokens // bs):
            for h in range(heads):
                k = kv[layer, 0, b * bs : (b + 1) * bs, h, :]  # [bs, dim]
                v = kv[layer, 1, b * bs : (b + 1) * bs, h, :]
                out[layer, b, h] = torch.cat([k.t().reshape(-1), v.reshape(-1)])
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("bs", [1, 4, 16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_native_chunk_decodes_to_the_canonical_kv_bit_exact(bs: int, dtype: torch.dtype) -> None:
    kv = canonical(32, dtype, seed=bs)
    code = layouts.blocks_kt(bs)
    assert code is not None and layouts.block_size_of(code) == bs
    native = reference(kv, bs)
    buf = codec.encode(NativeKV(code, native, tuple(kv.shape)), FP, key="k")
    assert len(buf) == codec.encoded_size(kv.numel() * kv.element_size())  # same bytes, another order
    head = codec.read_header(buf)
    assert head.layout == code and head.shape == tuple(kv.shape)
    assert codec.check(buf, key="k", fingerprint=FP, dtype=str(dtype).removeprefix("torch.")) == tuple(kv.shape)
    assert bits_equal(codec.decode(buf, key="k", fingerprint=FP, dtype=dtype), kv)
    got = codec.decode_native(buf, key="k", fingerprint=FP, dtype=dtype, shape=tuple(kv.shape))
    assert isinstance(got, NativeKV) and got.layout == code and bits_equal(got.data, native)
    with pytest.raises(CorruptDataError):
        codec.decode(buf, key="other", fingerprint=FP, dtype=dtype)  # bound to its key, as canonical chunks
    # a canonical chunk of the same KV: the same elements, so the same canonical KV out
    plain = codec.encode(kv, FP, key="k")
    assert codec.read_header(plain).layout == codec.LAYOUT_CANONICAL
    assert bits_equal(codec.decode(plain, key="k", fingerprint=FP, dtype=dtype), kv)


@pytest.mark.parametrize(
    "layout, why",
    [(0x20, "unknown family"), (0x05, "unknown code"), (0x16, "64-token blocks in 32 tokens"), (0xFF, "unknown")],
)
def test_a_bad_layout_byte_is_corrupt_data_whatever_the_checksum(layout: int, why: str) -> None:
    kv = canonical(32)
    buf = bytearray(codec.encode(NativeKV(layouts.blocks_kt(4) or 0, reference(kv, 4), tuple(kv.shape)), FP, key="k"))
    buf[7] = layout
    for verify in (True, False):  # the header is refused before any checksum is looked at
        with pytest.raises(CorruptDataError):
            codec.decode(buf, key="k", fingerprint=FP, dtype=torch.bfloat16, verify=verify)
    with pytest.raises(CorruptDataError):
        codec.read_header(buf)


def test_native_kv_that_does_not_fit_its_claim_is_refused_before_anything_is_written() -> None:
    kv = canonical(32)
    code = layouts.blocks_kt(8)
    assert code is not None
    spec = ModelSpec(model_id="m", dtype="bfloat16", num_layers=L, num_kv_heads=H, head_dim=D)
    good = NativeKV(code, reference(kv, 8), tuple(kv.shape))
    assert good.check(spec, 32) is good
    bad = [
        NativeKV(code, reference(kv, 8)[:, :3], tuple(kv.shape)),  # three blocks for four
        NativeKV(code, reference(kv, 8).float(), tuple(kv.shape)),  # the spec's dtype is bf16
        NativeKV(code, reference(kv, 8), (L, 2, 24, H, D)),  # 24 tokens claimed
        NativeKV(0x17, reference(kv, 8), tuple(kv.shape)),  # 128-token blocks do not fit 32 tokens
    ]
    for native in bad:
        with pytest.raises(KVShapeError):
            native.check(spec, 32)
    with pytest.raises(CorruptDataError):
        codec.encode(bad[0], FP, key="k")
    assert layouts.blocks_kt(0) is None and layouts.blocks_kt(48) is None and layouts.blocks_kt(1 << 16) is None


def test_the_fp8_tier_stores_a_native_chunk_lossless() -> None:
    """fp8 scales are per (layer, plane, head) of canonical KV: a native chunk is not quantized."""
    kv = canonical(32)
    native = codec.encode(NativeKV(layouts.blocks_kt(8) or 0, reference(kv, 8), tuple(kv.shape)), FP, key="k")
    assert compress.quantize(memoryview(native)) is None
    assert compress.quantize(memoryview(codec.encode(kv, FP, key="k"))) is not None


def engine(blocks: int, bs: int, dtype: torch.dtype = torch.bfloat16) -> tuple[EngineBlocks, list[torch.Tensor]]:
    """A CPU engine's KV tensors in vLLM's `cpu_vec` layout `[blocks, heads, bs, 2 * dim]`, one per layer."""
    layout = BlockLayout("cpu_vec", bs, H, D)
    layers = [torch.full((blocks, H, bs, 2 * D), -7.0, dtype=dtype) for _ in range(L)]
    return EngineBlocks(layout, [layout.planes(x) for x in layers], layers), layers


@pytest.mark.parametrize("first, stop", [(0, 64), (16, 64), (0, 53), (16, 37), (8, 64)])
def test_native_and_canonical_loads_put_the_same_bits_in_the_blocks(first: int, stop: int) -> None:
    """A chunk in the blocks' own layout lands in the same slots, bit for bit, as its canonical form
    through the transposing copy: whole blocks, a block `first` ends inside, a block `stop` cuts."""
    bs, chunk = 8, 32
    kv = canonical(64, seed=3)
    ids = [11, 3, 4, 5, 0, 9, 10, 2]  # runs of consecutive ids and single blocks
    code = layouts.blocks_kt(bs)
    by_canon, layers_a = engine(12, bs)
    by_native, layers_b = engine(12, bs)
    assert by_native.native_code == code
    ta = by_canon.target(ids, first, 64, stop)
    tb = by_native.target(ids, first, 64, stop)
    for c in range(2):
        part = kv[:, :, c * chunk : (c + 1) * chunk]
        ta.write(c * chunk, part)
        tb.write_native(c * chunk, chunk, NativeKV(code or 0, reference(part.contiguous(), bs), tuple(part.shape)))
    assert ta.close() == tb.close() == {0, chunk}
    for a, b in zip(layers_a, layers_b):
        assert bits_equal(a, b)
    untouched = [b for b in range(12) if b not in ids[first // bs : (stop + bs - 1) // bs]]
    assert all(bool((layers_b[0][b] == -7.0).all()) for b in untouched)
    # and back out: the blocks' own memory is the reference payload, canonical is the KV
    full, _ = engine(12, bs)
    full.target(ids, 0, 64, 64).write(0, kv)
    assert bits_equal(full.gather_native(ids), reference(kv, bs))
    assert bits_equal(full.gather(ids, 64, torch.empty_like(kv)), kv)


async def test_the_store_keeps_native_chunks_and_serves_every_reader_exact_after_a_restart(tmp_path: Path) -> None:
    bs, chunk = 16, 32
    spec = ModelSpec(model_id="m", dtype="bfloat16", num_layers=L, num_kv_heads=H, head_dim=D)
    config = StoreConfig(path=tmp_path / "data", chunk_tokens=chunk, lmdb_map_size=64 << 20)
    kv = canonical(96, seed=5)
    tokens = list(range(100, 196))
    code = layouts.blocks_kt(bs)
    assert code is not None
    async with StateStore.open(config, spec) as store:
        chunks = {i: NativeKV(code, reference(kv[:, :, i * chunk : (i + 1) * chunk].contiguous(), bs),
                              (L, 2, chunk, H, D)) for i in range(3)}  # fmt: skip
        assert await store.put_chunks(tokens, chunks) == 96
        with pytest.raises(AgentStateError):  # a wrong claim stores nothing
            await store.put_chunks(tokens + [1] * 32, {3: NativeKV(code, chunks[0].data[:, :1], (L, 2, chunk, H, D))})
    async with StateStore.open(config, spec) as store:  # from LMDB, after a restart
        out = torch.zeros_like(kv)
        assert await store.load(tokens, out) == 96
        assert bits_equal(out, kv)  # converted for a canonical reader
        assert store.chunks.counters().get("layout_conversions", 0) == 3
        blocks, layers = engine(8, bs)
        ids = [5, 6, 7, 0, 1, 2]
        assert await store.load(tokens, blocks.target(ids, 0, 96, 96)) == 96
        assert store.chunks.counters()["layout_conversions"] == 3  # the blocks' own layout: copied as it is
        assert bits_equal(blocks.gather(ids, 96, torch.empty_like(kv)), kv)
        assert await store.match(tokens + [7]) is not None
    assert sum(1 for _ in (tmp_path / "data").rglob("*")) > 0
