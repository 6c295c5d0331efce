"""transformers adapter: `DynamicCache` <-> canonical KV, and store helpers for generate loops.

A `DynamicCache` holds one `DynamicLayer` per decoder layer, `keys` / `values` shaped `[batch,
kv_heads, tokens, head_dim]`; canonical KV is `[layers, planes, tokens, kv_heads, head_dim]`.
Storing gathers the layers into one canonical tensor (one copy). Restoring makes no copy: the store
writes into a fresh canonical tensor and the cache's layers are transposed views of it.
`DynamicLayer.update` appends with `torch.cat`, which reads views fine and returns a contiguous
tensor, so the first step after a restore pays only the concatenation every step pays anyway, and
attention never sees a strided cache.

Only full-attention `DynamicLayer`s, batch size 1. Sliding-window, chunked, static, quantized and
linear-attention layers hold something other than "the KV of every token so far" (a window, a
ring buffer, quantized blocks, a recurrent state): storing them as canonical KV would silently
serve wrong state, so they raise `UnsupportedCacheError`. A session is one sequence: split a batch
with `cache.batch_select_indices` and store each row as its own session.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from pydantic import ValidationError
from transformers import DynamicCache, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

from agentstate.adapters import transformers_state as hybrid
from agentstate.errors import InvalidArgumentError, KVShapeError, SpecMismatchError
from agentstate.manifest import SessionManifest
from agentstate.spec import DTYPE_NAMES, DTYPES, ModelSpec
from agentstate.store import StateStore

ModelOrConfig = PreTrainedModel | PreTrainedConfig
Tokens = Sequence[int] | torch.Tensor

__all__ = ["Prefix", "Resumed", "UnsupportedCacheError", "cache_to_kv", "kv_to_cache", "load_prefix", "prefill", "put_prefix",
           "resume", "snapshot", "spec_for"]  # fmt: skip


class UnsupportedCacheError(InvalidArgumentError):
    """The cache or model keeps per-layer state that is not full-attention KV (sliding window, static, quantized...)."""


class Resumed(NamedTuple):
    """A restored session: `cache` covers `tokens[:restored_tokens]`; feed `tokens[restored_tokens:]` next."""

    tokens: list[int]
    cache: DynamicCache
    state: dict[str, Any]
    restored_tokens: int


class Prefix(NamedTuple):
    """A reused shared prefix: `cache` covers the first `tokens` tokens of the prompt."""

    tokens: int
    cache: DynamicCache


# -- model facts -------------------------------------------------------------------------------


def _text_config(model_or_config: ModelOrConfig) -> PreTrainedConfig:
    config = model_or_config.config if isinstance(model_or_config, PreTrainedModel) else model_or_config
    if not isinstance(config, PreTrainedConfig):
        raise InvalidArgumentError(f"expected a transformers model or config, got {type(model_or_config).__name__}")
    return config.get_text_config(decoder=True)


def _check_full_attention(config: PreTrainedConfig) -> None:
    kinds = set(get_layer_types_and_kwargs(config)[0])
    if kinds - {"full_attention"}:
        raise UnsupportedCacheError(
            f"layer types {sorted(kinds)}: only full-attention layers can be stored as canonical KV"
        )


def _shape(config: PreTrainedConfig) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of the whole model (all TP ranks together)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def _model_dtype(model_or_config: ModelOrConfig) -> torch.dtype | None:
    if isinstance(model_or_config, PreTrainedModel):
        return model_or_config.dtype
    dtype = getattr(model_or_config, "dtype", None)
    return DTYPES.get(dtype) if isinstance(dtype, str) else dtype


def _hybrid(config: PreTrainedConfig) -> bool:
    return set(get_layer_types_and_kwargs(config)[0]) != {"full_attention"}


_SHAPES: weakref.WeakKeyDictionary[PreTrainedModel, hybrid.CacheShape] = weakref.WeakKeyDictionary()


def _cache_shape(model_or_config: ModelOrConfig, cache: DynamicCache | None) -> hybrid.CacheShape:
    """A hybrid model's cache shape: from `cache`, else from one token through the model (once per
    model: the sizes of linear-attention states are known only to the layers that make them)."""
    if cache is not None:
        return hybrid.shape_of(cache)
    if not isinstance(model_or_config, PreTrainedModel):
        raise UnsupportedCacheError("a hybrid model's state shapes come from its layers: pass the model, or a cache")
    shape = _SHAPES.get(model_or_config)
    if shape is None:
        with torch.no_grad():
            out = model_or_config(torch.zeros(1, 1, dtype=torch.long, device=model_or_config.device), use_cache=True)
        shape = _SHAPES[model_or_config] = hybrid.shape_of(getattr(out, "cache", None) or out.past_key_values)
    return shape


def spec_for(
    model_or_config: ModelOrConfig,
    *,
    model_id: str | None = None,
    revision: str | None = None,
    dtype: torch.dtype | str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    cache: DynamicCache | None = None,
) -> ModelSpec:
    """The ModelSpec of a model's KV: its shape from the config, its dtype from the weights.

    A hybrid model (sliding-window, Mamba, GatedDeltaNet or short-conv layers beside full attention):
    the spec's KV is its full-attention layers' and its `state` the rest (`transformers_state`), whose
    shapes come from a cache (`cache`, or one token through the model).

    `model_id` defaults to the checkpoint the config was loaded from; a config built in code names
    none, and two models of one shape must never share state, so then it must be given. The
    revision defaults to the loaded commit hash, else "main". Under tensor parallelism each rank
    holds `num_key_value_heads / tp_size` heads.
    """
    config = _text_config(model_or_config)
    shape = _cache_shape(model_or_config, cache) if _hybrid(config) else None
    if shape is not None and tp_size != 1:
        raise UnsupportedCacheError("a hybrid model's state is stored at tp_size 1 only so far")
    model_id = model_id or getattr(config, "_name_or_path", None) or None
    if not model_id:
        raise InvalidArgumentError("this config names no checkpoint: pass model_id= (it keys every stored chunk)")
    revision = revision or getattr(config, "_commit_hash", None) or "main"
    torch_dtype = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    torch_dtype = torch_dtype or _model_dtype(model_or_config)
    if torch_dtype not in DTYPE_NAMES:
        raise InvalidArgumentError(f"KV dtype {dtype or torch_dtype} unknown or not given: pass dtype=")
    layers, kv_heads, head_dim = _shape(config)
    if shape is not None:
        layers, kv_heads, head_dim = len(shape.kv_layers), shape.kv_heads, shape.head_dim
    if tp_size < 1 or kv_heads % tp_size:
        raise InvalidArgumentError(f"{kv_heads} KV heads do not split over tp_size={tp_size}")
    try:
        return ModelSpec(
            model_id=model_id, revision=revision, dtype=DTYPE_NAMES[torch_dtype], num_layers=layers,
            num_kv_heads=kv_heads // tp_size, head_dim=head_dim, tp_rank=tp_rank, tp_size=tp_size,
            state=shape.state if shape is not None else None,
        )  # fmt: skip
    except ValidationError as exc:
        raise InvalidArgumentError(f"no valid ModelSpec for this model: {exc}") from None


def _check_compatible(spec: ModelSpec, model: PreTrainedModel) -> None:
    """Refuse, before any IO, to load a store's state into a model of another shape or dtype."""
    config = _text_config(model)
    shape = _cache_shape(model, None) if _hybrid(config) else None
    if shape is not None or spec.state is not None:
        have_h = (len(shape.kv_layers), shape.kv_heads, shape.head_dim, shape.state) if shape else None
        if have_h != (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.state):
            raise SpecMismatchError("the model's layers (full attention, sliding, linear state) are not the store's spec's")
        return
    layers, kv_heads, head_dim = _shape(config)
    have = (layers, kv_heads // spec.tp_size, head_dim, model.dtype)
    want = (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.torch_dtype)
    if have != want:
        raise SpecMismatchError(f"model has (layers, kv heads, head dim, dtype) {have}, the store's spec {want}")


# -- conversions -------------------------------------------------------------------------------


def _layers(cache: object, spec: ModelSpec) -> tuple[list[DynamicLayer], int]:
    """The cache's layers, checked against `spec`, and how many tokens they hold."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        raise UnsupportedCacheError(f"expected a transformers DynamicCache, got {type(cache).__name__}")
    odd = {type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer}
    if odd:
        raise UnsupportedCacheError(f"cache layers {sorted(odd)}: only full-attention DynamicLayer can be stored")
    if len(layers) != spec.num_layers:
        raise KVShapeError(f"cache has {len(layers)} layers, spec {spec.num_layers}")
    lengths = {layer.get_seq_length() for layer in layers}
    if len(lengths) != 1:
        raise KVShapeError(f"cache layers hold different token counts {sorted(lengths)}")
    seq = lengths.pop()
    want = (1, spec.num_kv_heads, seq, spec.head_dim)
    for i, layer in enumerate(layers if seq else []):
        for name, t in (("keys", layer.keys), ("values", layer.values)):
            assert t is not None  # a layer holding tokens has tensors
            if t.dim() == 4 and t.shape[0] != 1:
                raise KVShapeError(f"batch size {t.shape[0]}: canonical KV is one sequence; store each row alone")
            if tuple(t.shape) != want or t.dtype != spec.torch_dtype:
                raise KVShapeError(
                    f"layer {i} {name} is {tuple(t.shape)} {t.dtype}, the spec needs {want} {spec.dtype}"
                )
    return layers, seq


def cache_to_kv(cache: DynamicCache, spec: ModelSpec, *, num_tokens: int | None = None) -> torch.Tensor:
    """Canonical KV of the first `num_tokens` (default all) tokens of `cache`: one gather copy, on its device."""
    layers, seq = _layers(cache, spec)
    n = seq if num_tokens is None else num_tokens
    if not 0 <= n <= seq:
        raise KVShapeError(f"num_tokens {n} outside a cache of {seq} tokens")
    device = layers[0].keys.device if seq and layers[0].keys is not None else torch.device("cpu")
    kv = spec.empty_kv(n, device=device)
    for i, layer in enumerate(layers if n else []):
        kv[i, 0].copy_(layer.keys[0, :, :n].transpose(0, 1))  # type: ignore[index]
        kv[i, 1].copy_(layer.values[0, :, :n].transpose(0, 1))  # type: ignore[index]
    return kv


def _layer(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    """A DynamicLayer holding exactly these tensors (`update` would copy them through `torch.cat`)."""
    layer = DynamicLayer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    return layer


def kv_to_cache(kv: torch.Tensor, model_or_config: ModelOrConfig, *, copy: bool = True) -> DynamicCache:
    """A fresh DynamicCache holding canonical `kv` (`[layers, 2, tokens, heads, dim]`).

    `copy=True` gives each layer its own contiguous tensors on the model's device (kv's device when
    given a config). `copy=False` makes the layers views of `kv` (no copy; kv must already be on that
    device, and must not be written afterwards): the restore path, where kv is a fresh buffer.
    The dtype is never converted: a cast would not be the stored state.
    """
    config = _text_config(model_or_config)
    _check_full_attention(config)
    layers, kv_heads, head_dim = _shape(config)
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5:
        raise KVShapeError("kv must be a 5-dim canonical tensor [layers, planes, tokens, heads, dim]")
    n_layers, planes, _, heads, dim = kv.shape
    if (n_layers, planes, dim) != (layers, 2, head_dim) or heads == 0 or kv_heads % heads:
        raise KVShapeError(
            f"kv shape {tuple(kv.shape)} does not fit {layers} layers x 2 planes x {kv_heads} heads x {head_dim}"
        )
    dtype = _model_dtype(model_or_config)
    if isinstance(model_or_config, PreTrainedModel) and kv.dtype != dtype:
        raise KVShapeError(f"kv dtype {kv.dtype}, model dtype {dtype}")
    device = model_or_config.device if isinstance(model_or_config, PreTrainedModel) else kv.device
    if not copy and kv.device != device:
        raise InvalidArgumentError(f"copy=False needs kv on the model's device {device}, it is on {kv.device}")

    def place(plane: torch.Tensor) -> torch.Tensor:
        view = plane.transpose(0, 1).unsqueeze(0)  # [tokens, heads, dim] -> [1, heads, tokens, dim]
        return torch.empty(view.shape, dtype=kv.dtype, device=device).copy_(view) if copy else view

    cache = DynamicCache()
    cache.layers = [_layer(place(kv[i, 0]), place(kv[i, 1])) for i in range(layers)]
    return cache


# -- store helpers -----------------------------------------------------------------------------


def _token_list(tokens: Tokens) -> list[int]:
    """Token ids from a list or from `input_ids` (`[tokens]` or `[1, tokens]`)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() == 2 and tokens.shape[0] != 1:
            raise KVShapeError(f"input_ids batch size {tokens.shape[0]}: one sequence per call")
        if tokens.dim() not in (1, 2):
            raise InvalidArgumentError(f"input_ids must be [tokens] or [1, tokens], got {tuple(tokens.shape)}")
        return [int(t) for t in tokens.reshape(-1).tolist()]
    return [int(t) for t in tokens]


def _covering(store: StateStore, tokens: Tokens, cache: DynamicCache) -> list[int]:
    toks = _token_list(tokens)
    _, seq = _layers(cache, store.spec)
    if seq != len(toks):
        raise KVShapeError(f"cache holds {seq} tokens, {len(toks)} token ids given: they must be the same tokens")
    return toks


def _hybrid_covering(
    store: StateStore, tokens: Tokens, cache: DynamicCache
) -> tuple[list[int], torch.Tensor, dict[str, torch.Tensor]]:
    """(tokens, full-attention KV, model state) of a hybrid cache that has seen exactly `tokens`."""
    kv, carried, seen = hybrid.split(cache, store.spec)
    toks = _token_list(tokens)
    if seen != len(toks):
        raise KVShapeError(f"cache has seen {seen} tokens, {len(toks)} token ids given: they must be the same tokens")
    return toks, kv, carried


async def snapshot(
    store: StateStore,
    session_id: str,
    tokens: Tokens,
    cache: DynamicCache,
    state: dict[str, Any] | None = None,
    *,
    ttl_seconds: float | None = None,
    pinned: bool = False,
) -> SessionManifest:
    """Durably store a session whose `cache` covers exactly `tokens` (the ids fed to the model so far).

    A token sampled but not yet fed is not in the cache: keep it in `state` to continue from it.
    A hybrid model's state (its sliding windows, SSM and conv states) is stored with it.
    """
    if store.spec.state is not None:
        toks, kv, carried = _hybrid_covering(store, tokens, cache)
        return await store.snapshot(session_id, toks, kv, state, ttl_seconds=ttl_seconds, pinned=pinned,
                                    model_state=carried)  # fmt: skip
    toks = _covering(store, tokens, cache)
    kv = cache_to_kv(cache, store.spec)
    return await store.snapshot(session_id, toks, kv, state, ttl_seconds=ttl_seconds, pinned=pinned)


async def resume(store: StateStore, session_id: str, model: PreTrainedModel, *, leave_last: bool = False) -> Resumed:
    """Restore a session into a fresh DynamicCache for `model` (layers are views of the restored KV).

    `leave_last=True` keeps the last token out of the cache, for `model.generate(input_ids=tokens,
    cache=...)`, which must feed at least one token to get logits. Missing or corrupt stored data
    shortens `restored_tokens`; recompute the rest from `tokens`.
    """
    _check_compatible(store.spec, model)
    if store.spec.state is not None and leave_last:
        raise InvalidArgumentError(
            "a hybrid model's state is valid after the last token only: resume whole and feed the next token"
        )
    result = await store.resume(session_id)
    assert result.kv is not None  # resume without `into` always returns the tensor
    if store.spec.state is not None:
        if result.model_state is None or not result.complete:  # whole or nothing: recompute from tokens
            return Resumed(tokens=result.tokens, cache=DynamicCache(config=model.config), state=result.state,
                           restored_tokens=0)  # fmt: skip
        built = hybrid.build(model.config, store.spec, result.kv, result.model_state, model.device)
        return Resumed(tokens=result.tokens, cache=built, state=result.state, restored_tokens=result.restored_tokens)
    n = min(result.restored_tokens, len(result.tokens) - 1) if leave_last else result.restored_tokens
    cache = _cache_of(result.kv[:, :, :n], model)
    return Resumed(tokens=result.tokens, cache=cache, state=result.state, restored_tokens=n)


def _cache_of(kv: torch.Tensor, model: PreTrainedModel) -> DynamicCache:
    if kv.shape[2] == 0:
        return DynamicCache(config=model.config)
    return kv_to_cache(kv, model, copy=kv.device != model.device)


async def load_prefix(store: StateStore, tokens: Tokens, model: PreTrainedModel, *, leave_last: bool = True) -> Prefix:
    """Reuse the stored shared prefix of a prompt: a cache of its first `n` tokens; prefill `tokens[n:]`.

    KV lands straight in a tensor on the model's device, sized to the prompt's whole chunks.
    `leave_last` (default) keeps at least the last prompt token out, so the prefill that follows
    yields the logits of the next token even when the whole prompt was stored.
    """
    _check_compatible(store.spec, model)
    toks = _token_list(tokens)
    if store.spec.state is not None:
        return await _load_hybrid(store, toks, model, leave_last)
    chunked = len(toks) // store.chunk_tokens * store.chunk_tokens
    if chunked == 0:
        return Prefix(0, DynamicCache(config=model.config))
    kv = store.spec.empty_kv(chunked, device=model.device)
    n = await store.load(toks, kv)
    if leave_last:
        n = min(n, len(toks) - 1)
    return Prefix(n, _cache_of(kv[:, :, :n], model))


async def _load_hybrid(store: StateStore, toks: list[int], model: PreTrainedModel, leave_last: bool) -> Prefix:
    """A hybrid model's stored prefix: KV up to the last boundary stored (`prefill`), and the model's
    state there; nothing when either is missing (the state is the KV's, or the prefix is recomputed)."""
    usable = toks[: len(toks) - 1] if leave_last else toks
    chunked = len(usable) // store.chunk_tokens * store.chunk_tokens
    empty = Prefix(0, DynamicCache(config=model.config))
    if chunked == 0:
        return empty
    kv = store.spec.empty_kv(chunked)
    n = await store.load(usable[:chunked], kv)
    carried = await store.prefix_state(usable, n) if n else None
    if carried is None:
        return empty
    return Prefix(n, hybrid.build(model.config, store.spec, kv[:, :, :n], carried, model.device))


async def prefill(store: StateStore, tokens: Tokens, model: PreTrainedModel, *, every: int | None = None) -> DynamicCache:
    """Run `model` over `tokens` and return its cache, storing the shared prefix on the way: a hybrid
    model's state is valid after one position only, so the prompt is fed in pieces of `every` chunks
    (default `StoreConfig.state_boundary_chunks`) and each boundary stored with its KV (`put_prefix`),
    the points a later `load_prefix` resumes from. A dense model is fed in one piece and its whole
    chunks stored. Starts from the longest stored prefix."""
    _check_compatible(store.spec, model)
    toks = _token_list(tokens)
    found = await load_prefix(store, toks, model)
    cache, done = found.cache, found.tokens
    c = store.chunk_tokens
    step = (every or store.config.state_boundary_chunks) * c if store.spec.state is not None else len(toks)
    if step <= 0:
        raise InvalidArgumentError(f"every must be >= 1 chunk, got {every}")
    with torch.no_grad():
        while done < len(toks):
            end = min(len(toks), (done // step + 1) * step)
            out = model(torch.tensor([toks[done:end]], device=model.device), cache=cache, use_cache=True)
            cache, done = getattr(out, "cache", None) or out.past_key_values, end
            if store.spec.state is not None and end % c == 0:
                await put_prefix(store, toks[:end], cache)
    if store.spec.state is None:
        await put_prefix(store, toks, cache)
    return cache


async def put_prefix(store: StateStore, tokens: Tokens, cache: DynamicCache) -> int:
    """Store a shared prefix (its whole chunks) from a cache covering exactly `tokens`; returns new tokens stored.

    A hybrid model's cache must have seen whole chunks (its state is the boundary a later
    `load_prefix` resumes from; `prefill` stores one every few chunks)."""
    if store.spec.state is not None:
        toks, kv, carried = _hybrid_covering(store, tokens, cache)
        return await store.put_prefix(toks, kv, model_state=carried)
    toks = _covering(store, tokens, cache)
    chunked = len(toks) // store.chunk_tokens * store.chunk_tokens
    if chunked == 0:
        return 0
    return await store.put_prefix(toks[:chunked], cache_to_kv(cache, store.spec, num_tokens=chunked))
