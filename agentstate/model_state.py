"""A hybrid model's state at a position, as one stored value: the tensors of a `StateLayout`, their
bytes one after another in the layout's order.

What a hybrid model carries besides per-token KV (a Mamba or GatedDeltaNet layer's conv and recurrent
state, a short-conv layer's conv state, a sliding-window layer's last tokens) is valid at exactly one
position: it cannot be cut into chunks or narrowed to a prefix. So it is stored whole, as raw bytes
(never quantized, never converted: an fp8 tier leaves a uint8 value as it is), in a codec value of the
spec's `state_spec` bound to its key like every chunk. A session keeps the state at its end beside its
tail (`SessionManifest.state_key`), written before its manifest commits, named by it, kept and
collected with it: a resume gets the KV and the state of the same version, or neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agentstate.errors import KVShapeError
from agentstate import spec as specs
from agentstate.spec import ModelSpec, StateLayout

if TYPE_CHECKING:
    import torch

    from agentstate.chunks import ChunkStore


def layout_of(spec: ModelSpec) -> StateLayout:
    if spec.state is None:
        raise KVShapeError(f"spec {spec.model_id} holds no model state (every layer is full attention)")
    return spec.state


def checked(spec: ModelSpec, tensors: Any, position: int) -> torch.Tensor | None:
    """`tensors` packed (`pack`) when `spec` is a hybrid model's, None when it is a dense model's and
    none are given; KVShapeError when one is given without the other: what every write that takes a
    model state (a snapshot, a prefix boundary) checks before anything is written."""
    if (tensors is None) != (spec.state is None):
        raise KVShapeError(
            "this spec is a hybrid model's: pass model_state= (its state after the last token)" if tensors is None
            else "model_state= is a hybrid model's state; this spec has no state layout"
        )
    return None if tensors is None else pack(spec, tensors, position)


async def read(chunks: ChunkStore, spec: ModelSpec, key: str, position: int) -> dict[str, torch.Tensor] | None:
    """The state stored under `key` (after `position` tokens) from the fastest tier holding it intact,
    read as `spec.state_spec`'s value; None when none does (the key pinned by the caller)."""
    import torch

    layout, encoded = layout_of(spec), spec.state_spec
    assert encoded is not None  # a spec with a layout has one
    size = layout.nbytes_at(position)
    payload = torch.empty(encoded.kv_shape(size), dtype=torch.uint8)
    await chunks.discover([key])
    ok = await chunks.read_as(encoded, [key], [size], lambda _, src: payload.copy_(src))
    return unpack(spec, payload, position) if ok[0] else None


def pack(spec: ModelSpec, tensors: Mapping[str, torch.Tensor], position: int) -> torch.Tensor:
    """The state value's payload: `tensors` (the layout's, shaped for `position` tokens) as bytes,
    a `(1, 1, n, 1, 1)` uint8 tensor of `spec.state_spec`. KVShapeError for a missing, extra,
    misshapen or mistyped tensor: nothing is written."""
    import torch

    layout = layout_of(spec)
    if not isinstance(tensors, Mapping):
        raise KVShapeError(f"model_state must map tensor names to tensors, got {type(tensors).__name__}")
    names = [t.name for t in layout.tensors]
    if set(tensors) != set(names):
        missing, extra = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
        raise KVShapeError(f"model_state does not match the spec's layout: missing {missing[:8]}, unexpected {extra[:8]}")
    out = torch.empty(layout.nbytes_at(position), dtype=torch.uint8)
    at = 0
    for want in layout.tensors:
        t = tensors[want.name]
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
            raise KVShapeError(f"model_state[{want.name!r}] must be a dense tensor holding data")
        if tuple(t.shape) != want.shape_at(position) or t.dtype != specs.DTYPES[want.dtype]:
            raise KVShapeError(
                f"model_state[{want.name!r}] is {tuple(t.shape)} {t.dtype}, the layout needs"
                f" {want.shape_at(position)} {want.dtype} after {position} tokens"
            )
        n = want.nbytes_at(position)
        out[at : at + n].copy_(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8))
        at += n
    return out.view(1, 1, -1, 1, 1)


def unpack(spec: ModelSpec, payload: torch.Tensor, position: int) -> dict[str, torch.Tensor]:
    """The tensors of a state value's payload (views of it), by name; KVShapeError when its size is
    not the layout's at `position` (the codec checked its bytes, this checks they are this layout's)."""
    layout = layout_of(spec)
    flat = payload.reshape(-1)
    if flat.numel() != layout.nbytes_at(position):
        raise KVShapeError(f"a state value of {flat.numel()} bytes; the layout holds {layout.nbytes_at(position)}")
    out: dict[str, torch.Tensor] = {}
    at = 0
    for t in layout.tensors:
        n = t.nbytes_at(position)
        part = flat[at : at + n]
        if at % specs.ITEMSIZE[t.dtype]:  # a tensor after one of an odd byte count: a view would be misaligned
            part = part.clone()
        out[t.name] = part.view(specs.DTYPES[t.dtype]).view(t.shape_at(position))
        at += n
    return out
