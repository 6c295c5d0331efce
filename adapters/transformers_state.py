"""transformers hybrid caches: a `DynamicCache` of mixed layers <-> the canonical KV of its full-attention
layers and the model's state after its last token (`agentstate.model_state`).

transformers 5 keeps one cache layer per decoder layer: `DynamicLayer` (full attention: the KV of every
token, canonical KV as the dense path stores it), `DynamicSlidingWindowLayer` (the KV of the last
`sliding_window - 1` tokens), `LinearAttentionLayer` (Mamba, GatedDeltaNet, short conv: a conv state
and a recurrent state per sub-state, the same size at every position) and `DummyLayer` (nothing). A
hybrid model's state is everything but the full-attention KV, named `<layer>.<part>`: `3.keys` /
`3.values` of a sliding layer (its window: `window_dim` 2), `0.conv0` / `0.recurrent0` of a linear one.
It is valid after exactly the tokens the cache has seen, so it is taken and given back whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedConfig

from agentstate.errors import InvalidArgumentError, KVShapeError
from agentstate.spec import DTYPE_NAMES, ModelSpec, StateLayout, StateTensor


class UnsupportedLayerError(InvalidArgumentError):
    """A cache layer that is neither full attention, a sliding window, a linear-attention state nor empty."""


@dataclass(frozen=True)
class CacheShape:
    """What a cache's layers hold: the full-attention layers (canonical KV's layers, in order), their
    KV heads and head size, and the state layout of the rest (None: every layer is full attention)."""

    kv_layers: tuple[int, ...]
    kv_heads: int
    head_dim: int
    state: StateLayout | None


_KINDS = {  # cache layer class -> (full-attention KV, sliding window, linear-attention state)
    "DynamicLayer": (True, False, False),
    "DynamicSlidingWindowLayer": (False, True, False),
    "LinearAttentionLayer": (False, False, True),
    "LinearAttentionAndFullAttentionLayer": (True, False, True),
    "LinearAttentionAndSlidingWindowAttentionLayer": (False, True, True),
    "DummyLayer": (False, False, False),
}
"""The dynamic layers whose state is stored; static, quantized, offloaded or indexed layers hold
something else (a preallocated buffer, quantized blocks) and are refused."""


def _parts(layer: object) -> tuple[bool, bool, bool]:
    """(full-attention KV, sliding window, linear-attention state) of one cache layer."""
    kind = _KINDS.get(type(layer).__name__)
    if kind is None or not type(layer).__module__.startswith("transformers."):
        raise UnsupportedLayerError(f"cache layer {type(layer).__name__} holds state agentstate cannot store")
    return kind


def _states(i: int, layer: object) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of each conv and recurrent state a linear-attention layer `i` holds."""
    for j in range(layer.number_of_states):  # type: ignore[attr-defined]
        for part, found in (("conv", layer.conv_states[j]), ("recurrent", layer.recurrent_states[j])):  # type: ignore[attr-defined]
            if found is not None:
                yield f"{i}.{part}{j}", found


def shape_of(cache: DynamicCache) -> CacheShape:
    """The shape of a cache that has seen at least one token (a model's first forward makes its
    linear-attention states), batch size 1."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not layers:
        raise InvalidArgumentError(f"expected a transformers DynamicCache, got {type(cache).__name__}")
    kv_layers, tensors = [], []
    kv_shape: tuple[int, int] | None = None
    for i, layer in enumerate(layers):
        full, sliding, linear = _parts(layer)
        if full or sliding:
            keys = layer.keys  # type: ignore[attr-defined]
            if keys is None or keys.dim() != 4 or keys.shape[0] != 1:
                raise KVShapeError(f"layer {i}: batch size 1 and at least one token are needed to read its shape")
            if full:
                kv_layers.append(i)
                kv_shape = (keys.shape[1], keys.shape[3])
            else:
                window = int(layer.sliding_window) - 1  # type: ignore[attr-defined]
                shape = (1, keys.shape[1], window, keys.shape[3])
                tensors += [StateTensor(name=f"{i}.{part}", shape=shape, dtype=DTYPE_NAMES[keys.dtype], window_dim=2)
                            for part in ("keys", "values")]  # fmt: skip
        for name, found in _states(i, layer) if linear else ():
            if found.shape[0] != 1:
                raise KVShapeError(f"layer {i}: batch size {found.shape[0]}; one sequence per session")
            tensors.append(StateTensor(name=name, shape=tuple(found.shape), dtype=DTYPE_NAMES[found.dtype]))
    if kv_shape is None:
        raise UnsupportedLayerError("no full-attention layer: a model without per-token KV is not stored yet")
    return CacheShape(tuple(kv_layers), kv_shape[0], kv_shape[1], StateLayout(tensors=tuple(tensors)) if tensors else None)


def position_of(cache: DynamicCache) -> int:
    """How many tokens the cache has seen (every layer agreeing)."""
    seen = set()
    for layer in cache.layers:
        full, sliding, linear = _parts(layer)
        if full or sliding:
            seen.add(int(layer.get_seq_length()))  # type: ignore[attr-defined]
        if linear:
            seen.add(int(layer.cumulative_length_linear))  # type: ignore[attr-defined]
    if len(seen) != 1:
        raise KVShapeError(f"cache layers have seen different token counts {sorted(seen)}")
    return seen.pop()


def split(cache: DynamicCache, spec: ModelSpec) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """(canonical KV of the full-attention layers, the state tensors by name, tokens seen) of a
    hybrid cache matching `spec` (KVShapeError otherwise)."""
    shape = shape_of(cache)
    if shape.state != spec.state or len(shape.kv_layers) != spec.num_layers:
        raise KVShapeError("the cache's layers are not those of the store's spec (another model?)")
    n = position_of(cache)
    kv = spec.empty_kv(n)
    state: dict[str, torch.Tensor] = {}
    for k, i in enumerate(shape.kv_layers):
        layer = cache.layers[i]
        kv[k, 0].copy_(layer.keys[0].transpose(0, 1))  # type: ignore[attr-defined]
        kv[k, 1].copy_(layer.values[0].transpose(0, 1))  # type: ignore[attr-defined]
    for i, layer in enumerate(cache.layers):
        _, sliding, linear = _parts(layer)
        if sliding:
            state[f"{i}.keys"], state[f"{i}.values"] = layer.keys, layer.values  # type: ignore[attr-defined]
        state.update(_states(i, layer) if linear else ())
    return kv, state, n


def build(config: PreTrainedConfig, spec: ModelSpec, kv: torch.Tensor, state: dict[str, torch.Tensor],
          device: torch.device) -> DynamicCache:  # fmt: skip
    """A fresh cache for `config` holding `kv` (the full-attention layers', canonical) and `state`,
    as after `kv.shape[2]` tokens: the next forward continues from there."""
    cache = DynamicCache(config=config)
    n = kv.shape[2]
    full_layers = 0
    for i, layer in enumerate(cache.layers):
        full, sliding, linear = _parts(layer)
        if full:
            keys = kv[full_layers, 0].transpose(0, 1).unsqueeze(0).to(device).contiguous()
            values = kv[full_layers, 1].transpose(0, 1).unsqueeze(0).to(device).contiguous()
            layer.lazy_initialization(keys, values)  # type: ignore[attr-defined]
            layer.keys, layer.values = keys, values  # type: ignore[attr-defined]
            full_layers += 1
        if sliding:
            keys, values = (state[f"{i}.{p}"].to(device).clone() for p in ("keys", "values"))
            layer.lazy_initialization(keys, values)  # type: ignore[attr-defined]
            layer.keys, layer.values = keys, values  # type: ignore[attr-defined]
            layer.cumulative_length = n  # type: ignore[attr-defined]
        if linear:
            for j in range(layer.number_of_states):  # type: ignore[attr-defined]
                conv, recurrent = state.get(f"{i}.conv{j}"), state.get(f"{i}.recurrent{j}")
                if conv is None and recurrent is None:
                    continue
                layer.lazy_initialization(  # type: ignore[attr-defined]
                    conv_states=None if conv is None else conv.to(device),
                    recurrent_states=None if recurrent is None else recurrent.to(device), state_idx=j,
                )  # fmt: skip
                if conv is not None:
                    layer.conv_states[j].copy_(conv)  # type: ignore[attr-defined]
                if recurrent is not None:
                    layer.recurrent_states[j].copy_(recurrent)  # type: ignore[attr-defined]
                layer.has_previous_state[j] = True  # type: ignore[attr-defined]
            layer.cumulative_length_linear.fill_(n)  # type: ignore[attr-defined]
    if full_layers != spec.num_layers:
        raise KVShapeError(f"the model has {full_layers} full-attention layers, the spec {spec.num_layers}")
    return cache
