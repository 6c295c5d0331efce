"""transformers adapter: DynamicCache <-> canonical KV, snapshot/resume of generate loops, prefix reuse.

Models are tiny Llama- and Qwen2-shaped (GQA) decoders built from a config with seeded random
weights: nothing is downloaded. Every comparison that the store is responsible for is bitwise.

What the model computes is compared by what CPU kernels guarantee, so that the tests pass on any
machine and under any load:
- the same computation (same shapes, same input bits) run twice gives the same bits, given the same
  thread count: those comparisons are bitwise, with the thread count pinned (`pinned_threads`);
- a prefill over a restored cache against the matching rows of one longer prefill is NOT the same
  computation: the matmuls see M=8 rows against M=200 and block them differently (MKL picks its
  kernel by shape and by the CPU's instruction set), so the last bits differ by machine. Those are
  compared within `LOGITS_ATOL`, and their greedy tokens must be equal wherever the reference's
  top-2 margin is wider than twice that (`assert_close_logits`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from agentstate.adapters import transformers as tfa
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, StaticCache

from agentstate.errors import InvalidArgumentError, KVShapeError, SpecMismatchError
from tests.conftest import bits_equal

TINY: dict[str, Any] = {"vocab_size": 1000, "max_position_embeddings": 512, "tie_word_embeddings": False}
SHAPES: dict[str, Callable[..., Any]] = {
    # head_dim 16 (set by LlamaConfig); 4 query heads over 2 KV heads
    "llama": lambda **kw: LlamaForCausalLM(
        LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=kw.get("layers", 2),
                    num_attention_heads=4, num_key_value_heads=2, **TINY)
    ),
    # head_dim from hidden_size / heads = 16; 8 query heads over 2 KV heads
    "qwen2": lambda **kw: Qwen2ForCausalLM(
        Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=kw.get("layers", 3),
                    num_attention_heads=8, num_key_value_heads=2, **TINY)
    ),
}  # fmt: skip
STEPS = 8
LOGITS_ATOL = 1e-4
"""float32 logits of a prefill over restored KV against the same rows of a longer prefill: measured
at most 3.6e-7 apart (qwen2, 1-4 threads, AVX-512), on logits of magnitude ~1, while KV of other
tokens moves them by 0.2-0.9 and the right KV one position off by 1.4e-2 (llama) or more. The
tolerance leaves room for other instruction sets and stays two orders of magnitude below an error."""


def build(kind: str, dtype: torch.dtype = torch.float32, **kw: Any) -> Any:
    torch.manual_seed(0)
    return SHAPES[kind](**kw).to(dtype).eval()


def prompt(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def forward(model: Any, ids: torch.Tensor, cache: DynamicCache | None = None) -> tuple[torch.Tensor, DynamicCache]:
    out = model(input_ids=ids, cache=cache, use_cache=True)
    return out.logits, out.cache


def greedy(model: Any, cache: DynamicCache, token: int, steps: int = STEPS) -> tuple[list[int], list[torch.Tensor]]:
    """Decode `steps` tokens one at a time from `token` (not yet in `cache`)."""
    tokens, logits = [], []
    for _ in range(steps):
        step, cache = forward(model, torch.tensor([[token]]), cache)
        token = int(step[0, -1].argmax())
        tokens.append(token)
        logits.append(step)
    return tokens, logits


@pytest.fixture
def pinned_threads() -> Iterator[int]:
    """One intra-op thread for the test: where it claims bitwise equal model outputs, both sides run
    the very same kernels with the same work split, whatever the machine's core count or OMP_NUM_THREADS."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield 1
    finally:
        torch.set_num_threads(before)


def assert_close_logits(got: torch.Tensor, want: torch.Tensor, atol: float = LOGITS_ATOL) -> None:
    """`got` within `atol` of `want`, and the same greedy token at every position whose top-2 margin
    in `want` exceeds 2 * atol (where it does not, rounding alone may pick either token)."""
    assert got.shape == want.shape
    diff = float((got - want).abs().max())
    assert diff <= atol, f"logits differ by {diff:.3g} > {atol:g}"
    top2 = want.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * atol
    assert clear.any(), "no position with a clear greedy token: the comparison would prove nothing"
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def same_layers(a: Any, b: Any) -> bool:
    return len(a.layers) == len(b.layers) and all(
        bits_equal(x.keys, y.keys) and bits_equal(x.values, y.values) for x, y in zip(a.layers, b.layers)
    )


def spec_of(model: Any, kind: str) -> Any:
    return tfa.spec_for(model, model_id=f"test/tiny-{kind}")


@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_kv_round_trip_is_bitwise(kind: str, dtype: torch.dtype) -> None:
    model = build(kind, dtype)
    spec = spec_of(model, kind)
    cache: Any
    _, cache = forward(model, prompt(150))
    kv = tfa.cache_to_kv(cache, spec)
    assert tuple(kv.shape) == spec.kv_shape(150) and kv.dtype == dtype and kv.is_contiguous()
    assert bits_equal(kv[:, 0], torch.stack([layer.keys[0].transpose(0, 1) for layer in cache.layers]))
    assert bits_equal(kv[:, 1], torch.stack([layer.values[0].transpose(0, 1) for layer in cache.layers]))
    copied = tfa.kv_to_cache(kv, model)
    assert same_layers(copied, cache) and all(layer.keys.is_contiguous() for layer in copied.layers)
    viewed = tfa.kv_to_cache(kv, model, copy=False)
    assert same_layers(viewed, cache)
    assert all(layer.keys.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr() for layer in viewed.layers)
    assert bits_equal(tfa.cache_to_kv(viewed, spec), kv)
    assert bits_equal(tfa.cache_to_kv(cache, spec, num_tokens=64), kv[:, :, :64])


def test_spec_for_reads_the_config() -> None:
    llama, qwen = build("llama"), build("qwen2")
    s = tfa.spec_for(llama, model_id="x/llama")
    assert (s.num_layers, s.kv_planes, s.num_kv_heads, s.head_dim) == (2, 2, 2, 16)
    assert (s.dtype, s.revision, s.model_id) == ("float32", "main", "x/llama")
    q = tfa.spec_for(qwen.config, model_id="x/qwen", dtype=torch.bfloat16, tp_rank=1, tp_size=2)
    assert (q.num_layers, q.num_kv_heads, q.head_dim, q.dtype, q.tp_rank) == (3, 1, 16, "bfloat16", 1)
    with pytest.raises(InvalidArgumentError, match="model_id"):
        tfa.spec_for(llama)  # a config built in code names no checkpoint
    with pytest.raises(InvalidArgumentError, match="dtype"):
        tfa.spec_for(qwen.config, model_id="x/qwen")  # a bare config has no weights to take the dtype from
    with pytest.raises(InvalidArgumentError):
        tfa.spec_for(llama, model_id="x/llama", tp_size=3)


@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_resumed_generation_is_bitwise_identical(
    open_store: Callable[..., Any], kind: str, dtype: torch.dtype, pinned_threads: int
) -> None:
    """Decoding from the restored cache repeats decoding from the original one bit for bit: the caches
    are bitwise equal and every step has the same shapes on both sides, so the same kernels run on
    the same bits; the thread count is pinned (`pinned_threads`) so that both split the work alike."""
    model = build(kind, dtype)
    spec = spec_of(model, kind)
    ids = prompt(150)  # two 64-token chunks and a 22-token tail
    logits, cache = forward(model, ids)
    first = int(logits[0, -1].argmax())  # sampled, not yet fed: the session keeps it in its state
    async with open_store(spec) as store:
        await tfa.snapshot(store, "agent-1", ids, cache, state={"next": first})
    async with open_store(spec) as store:  # a new store object over the reopened data directory
        tokens, restored, state, n = await tfa.resume(store, "agent-1", model)
        again = await tfa.resume(store, "agent-1", model, leave_last=True)
    assert tokens == ids[0].tolist() and state == {"next": first} and n == 150
    assert same_layers(restored, cache)

    want_tokens, want_logits = greedy(model, copy.deepcopy(cache), first)
    got_tokens, got_logits = greedy(model, restored, first)
    assert got_tokens == want_tokens
    assert all(torch.equal(g, w) for g, w in zip(got_logits, want_logits, strict=True))

    # generate() must feed at least one prompt token: leave_last restores 149 and feeds the last.
    assert again.restored_tokens == 149 and again.cache.get_seq_length() == 149
    original = copy.deepcopy(cache)
    original.crop(-1)
    kw: dict[str, Any] = {"attention_mask": torch.ones_like(ids), "max_new_tokens": STEPS, "do_sample": False,
                          "pad_token_id": 0, "output_logits": True, "return_dict_in_generate": True}  # fmt: skip
    got = model.generate(input_ids=ids, cache=again.cache, **kw)
    want = model.generate(input_ids=ids, cache=original, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(g, w) for g, w in zip(got.logits, want.logits, strict=True))


@pytest.mark.parametrize("kind", SHAPES)
async def test_prefix_restore_then_prefill_matches_full_prefill(open_store: Callable[..., Any], kind: str) -> None:
    """The restored prefix KV is bitwise what was stored; the logits of a prefill over it match the full
    prefill's rows within LOGITS_ATOL, with the same greedy tokens where the margin allows (the row
    blocking of a shorter prefill is another computation: see the module's docstring)."""
    model = build(kind)
    spec = spec_of(model, kind)
    ids = prompt(200)
    _, prefix_cache = forward(model, ids[:, :128])  # the prefix's KV from its own, shorter prefill
    full_logits, _ = forward(model, ids)
    async with open_store(spec) as store:
        assert await tfa.put_prefix(store, ids[:, :128], prefix_cache) == 128
        assert await tfa.put_prefix(store, ids[:, :150], forward(model, ids[:, :150])[1]) == 0  # chunks dedupe
        n, cache = await tfa.load_prefix(store, ids, model)
        assert n == 128 and same_layers(cache, prefix_cache)  # the store's part: bitwise
        rest_logits, _ = forward(model, ids[:, 128:], cache)
        # The model's part is not bitwise here, and cannot be expected to be: the prefix KV came
        # from a 128-row prefill, the reference's from a 200-row one, and the projection matmuls
        # block their rows differently for M=128 and M=200; the rest's prefill has M=72.
        assert_close_logits(rest_logits, full_logits[:, 128:])

        # With the prefix KV taken from the full prefill itself the stored bytes are the reference's
        # own, yet the tail's prefill (M=8) still blocks differently from the full one (M=200): the
        # bits of its logits depend on the machine (qwen2 differs by ~4e-7 on AVX-512), so a tolerance.
        other = prompt(200, seed=1)
        other_logits, other_cache = forward(model, other)
        assert await tfa.put_prefix(store, other, other_cache) == 192  # whole chunks only
        n, cache = await tfa.load_prefix(store, other, model)
        assert n == 192
        assert same_layers(cache, tfa.kv_to_cache(tfa.cache_to_kv(other_cache, spec, num_tokens=192), model))
        tail_logits, _ = forward(model, other[:, 192:], cache)
        assert_close_logits(tail_logits, other_logits[:, 192:])

        # A prompt that is exactly the stored prefix still leaves its last token to prefill.
        n, cache = await tfa.load_prefix(store, ids[:, :128], model)
        assert n == 127 and cache.get_seq_length() == 127
        last_logits, _ = forward(model, ids[:, 127:128], cache)
        assert_close_logits(last_logits[:, -1], full_logits[:, 127])

        n, cache = await tfa.load_prefix(store, prompt(200, seed=9), model)  # nothing shared
        assert n == 0 and cache.get_seq_length() == 0


async def test_bad_input_is_refused_and_stored_data_stays(open_store: Callable[..., Any]) -> None:
    model = build("llama")
    spec = spec_of(model, "llama")
    ids = prompt(100)
    _, cache = forward(model, ids)
    _, batch2 = forward(model, prompt(100, batch=2))
    async with open_store(spec) as store:
        await tfa.snapshot(store, "s", ids, cache, state={"turn": 1})
        with pytest.raises(KVShapeError, match="batch size 2"):
            await tfa.snapshot(store, "s", ids, batch2)
        with pytest.raises(KVShapeError, match="batch size 2"):
            tfa.cache_to_kv(batch2, spec)
        with pytest.raises(KVShapeError, match="batch size 2"):
            await tfa.snapshot(store, "s", prompt(100, batch=2), cache)
        with pytest.raises(KVShapeError, match="same tokens"):
            await tfa.snapshot(store, "s", ids[:, :99], cache)
        with pytest.raises(KVShapeError, match="dtype"):
            tfa.kv_to_cache(tfa.cache_to_kv(cache, spec).to(torch.bfloat16), model)
        deeper = build("llama", layers=3)
        with pytest.raises(SpecMismatchError):
            await tfa.resume(store, "s", deeper)
        with pytest.raises(SpecMismatchError):
            await tfa.load_prefix(store, ids, deeper)
        with pytest.raises(KVShapeError, match="layers"):
            await tfa.snapshot(store, "s", ids, forward(deeper, ids)[1])
    with pytest.raises(SpecMismatchError, match="num_layers 3 != 2"):  # same data dir, another model's spec
        await open_store(spec_of(deeper, "llama"))
    async with open_store(spec) as store:
        result = await tfa.resume(store, "s", model)
        manifest = [m async for m in store.sessions()]
    assert result.state == {"turn": 1} and result.restored_tokens == 100 and same_layers(result.cache, cache)
    assert [m.version for m in manifest] == [1]


def test_non_full_attention_caches_are_refused() -> None:
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=1, **TINY)  # fmt: skip
    torch.manual_seed(0)
    sliding = Qwen2ForCausalLM(config).eval()
    windows = tfa.spec_for(sliding, model_id="x/sliding").state  # a hybrid spec now (tests/test_hybrid.py)
    assert windows is not None and all(t.window_dim == 2 for t in windows.tensors)
    full_spec = spec_of(build("llama"), "llama").model_copy(update={"num_kv_heads": 2, "head_dim": 16})
    _, cache = forward(sliding, prompt(40))
    with pytest.raises(tfa.UnsupportedCacheError, match="DynamicSlidingWindowLayer"):
        tfa.cache_to_kv(cache, full_spec)
    with pytest.raises(tfa.UnsupportedCacheError):
        tfa.kv_to_cache(full_spec.empty_kv(8), sliding)
    static = StaticCache(config=build("llama").config, max_cache_len=32)
    with pytest.raises(tfa.UnsupportedCacheError, match="StaticLayer"):
        tfa.cache_to_kv(static, full_spec)
    with pytest.raises(tfa.UnsupportedCacheError):
        tfa.cache_to_kv({"not": "a cache"}, full_spec)  # type: ignore[arg-type]


async def test_resume_with_lost_tail_recomputes_the_rest(open_store: Callable[..., Any]) -> None:
    model = build("qwen2")
    spec = spec_of(model, "qwen2")
    ids = prompt(150)
    logits, cache = forward(model, ids)
    async with open_store(spec) as store:
        manifest = await tfa.snapshot(store, "s", ids, cache)
    async with open_store(spec) as store:
        await store.chunks.backend(store.chunks.record_tier).delete([manifest.tail_key])  # the 22-token tail is lost on disk
        tokens, restored, _, n = await tfa.resume(store, "s", model)
    assert n == 128 and restored.get_seq_length() == 128
    assert same_layers(restored, tfa.kv_to_cache(tfa.cache_to_kv(cache, spec, num_tokens=128), model))
    rest, _ = forward(model, torch.tensor([tokens[n:]]), restored)
    # The restored 128 tokens are the original prefill's own KV (bitwise, above); recomputing the
    # 22 others over them is a 22-row prefill against rows of a 150-row one: within LOGITS_ATOL.
    assert_close_logits(rest, logits[:, n:])
