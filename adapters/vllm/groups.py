"""vLLM's KV cache groups, as the connector stores them: which layers are KV, which are state.

With its hybrid memory allocator (HMA) on, vLLM splits a model's layers into KV cache groups of one
kind each (`kv_cache_config.kv_cache_groups`), and a request has one list of block ids per group,
indexed by position (block `t // block_size` holds token `t`), with the null block (id 0) where a
group keeps nothing:

- full attention: every token's KV, as a dense model's;
- sliding window: only the blocks of the last `sliding_window` tokens stay the request's; earlier
  ones go back to the pool while the request runs (null from then on);
- Mamba (GatedDeltaNet, Mamba2, short conv) in "align" mode: a layer's state after the tokens up to a
  block boundary lives in the block that ends there, only where a step ended there; the others are
  null, and a state block goes back two steps after it was written.

So a chunk holds the KV of every attention layer (full and sliding: a sliding layer's KV of a token
is the same whatever comes after it), in the order vLLM registers the layers, and a Mamba model's
state is stored at chunk boundaries (`ModelSpec.state`: each Mamba layer's state tensors, as vLLM
binds them). Block ids come from the engine, so every group's are read here, by group. No vLLM
import: kv_cache_config is only read (by class name: a subclass, such as MLA's, is not these kinds).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

from agentstate.errors import InvalidArgumentError
from agentstate.spec import DTYPE_NAMES, StateLayout, StateTensor

log = logging.getLogger("vllm.agentstate")

NULL_BLOCK = 0
"""vLLM's null block: a position a group keeps nothing for (outside a window, a Mamba state not kept)."""

Kind = Literal["full", "sliding", "mamba"]
KINDS: dict[str, Kind] = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding", "MambaSpec": "mamba"}


@dataclass(frozen=True)
class KVGroups:
    """A hybrid model's KV cache groups: each group's kind, the attention layers' groups, the Mamba layers'."""

    kinds: tuple[Kind, ...]  # per group
    attention: dict[str, int]  # attention layer name -> its group
    mamba: dict[str, int]  # Mamba layer name -> its group
    windows: tuple[int | None, ...]  # per group: a sliding group's window (tokens)
    state: StateLayout | None  # the Mamba layers' state tensors, in `mamba` order (None: no Mamba layers)

    @property
    def state_group(self) -> int | None:
        """The Mamba group whose block at a boundary holds the state (they are allocated alike)."""
        return next(iter(self.mamba.values()), None)

    @property
    def sessions(self) -> bool:
        """Whether named sessions can be kept: a session is every token's KV and the state at its end,
        which a request's blocks hold when it finishes, unless a sliding group let earlier ones go."""
        return "sliding" not in self.kinds

    @property
    def window(self) -> int | None:
        """The narrowest sliding window: blocks before it may have left a running request."""
        return min((w for w in self.windows if w is not None), default=None)


def state_block(ids: list[int], tokens: int, block_size: int) -> int | None:
    """The block of a Mamba group's `ids` holding its state after `tokens` tokens: the block holding
    token `tokens - 1` (align mode keeps the state there); None where the group keeps none."""
    at = -(-tokens // block_size) - 1
    return ids[at] if 0 <= at < len(ids) and ids[at] != NULL_BLOCK else None


def groups_of(kv_cache_config: Any, block_size: int) -> KVGroups | None:
    """The groups of `kv_cache_config`, None for a model whose KV is one full-attention group (a dense
    model: stored as before); InvalidArgumentError for a kind of group the connector cannot store."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1 and all(type(g.kv_cache_spec).__name__ == "FullAttentionSpec" for g in groups):
        return None
    kinds: list[Kind] = []
    windows: list[int | None] = []
    attention: dict[str, int] = {}
    mamba: dict[str, int] = {}
    tensors: list[StateTensor] = []
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = KINDS.get(type(spec).__name__)
        if kind is None:
            raise InvalidArgumentError(
                f"KV cache group {i} is {type(spec).__name__}: the agentstate vLLM connector stores full-attention,"
                " sliding-window and Mamba (align mode) groups only"
            )
        if int(spec.block_size) != block_size:
            raise InvalidArgumentError(f"KV cache group {i} has block size {spec.block_size}, the engine {block_size}")
        kinds.append(kind)
        windows.append(int(spec.sliding_window) if kind == "sliding" else None)
        names = list(group.layer_names)
        if kind == "mamba":
            if spec.mamba_cache_mode != "align":
                raise InvalidArgumentError(
                    f"Mamba cache mode {spec.mamba_cache_mode!r}: the connector stores a hybrid model's state at block"
                    " boundaries, which vLLM keeps in 'align' mode (on with prefix caching: enable_prefix_caching)"
                )
            for name in names:
                mamba[name] = i
                tensors.extend(_state_tensors(name, spec))
        else:
            for name in names:
                attention[name] = i
    if not attention:
        raise InvalidArgumentError("a model without attention layers: nothing for chunks of KV to hold")
    hashed = getattr(kv_cache_config, "hash_block_size", None)
    if mamba and hashed and hashed < block_size:
        log.warning(
            "agentstate: vLLM hashes prefixes per %d tokens, its blocks hold %d: its prefill steps end between"
            " chunk boundaries, where no Mamba state is stored (fewer hits); ask vLLM for a block_size (it widens"
            " it to a state's page) to align them", hashed, block_size,
        )  # fmt: skip
    state = StateLayout(tensors=tuple(tensors)) if tensors else None
    return KVGroups(tuple(kinds), attention, mamba, tuple(windows), state)


def _state_tensors(layer: str, spec: Any) -> list[StateTensor]:
    """A Mamba layer's state tensors per block, as vLLM binds them (conv state first), named after the
    layer and, for the conv state, vLLM's conv layout (`VLLM_SSM_CONV_STATE_LAYOUT`): an engine that
    lays it out otherwise has another spec, so never reads these bytes."""
    conv_layout = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT") or "SD"  # vLLM's default when unset
    if conv_layout not in ("SD", "DS"):
        raise InvalidArgumentError(f"VLLM_SSM_CONV_STATE_LAYOUT {conv_layout[:20]!r} is neither SD nor DS")
    out = []
    for j, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes)):
        if dtype not in DTYPE_NAMES:
            raise InvalidArgumentError(f"Mamba layer {layer}: state dtype {dtype} cannot be stored")
        name = f"{layer}.s{j}" + (f".{conv_layout}" if j == 0 else "")
        out.append(StateTensor(name=name, shape=tuple(int(d) for d in shape), dtype=DTYPE_NAMES[dtype]))
    return out
