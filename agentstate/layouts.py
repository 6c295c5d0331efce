"""Chunk payload layouts: canonical KV, and engine-native layouts kept at rest.

A chunk's payload is canonical KV `[layers, planes, tokens, heads, dim]` (layout code 0), which
every engine reads with one strided copy, except where an engine's own block memory would need a
transposing copy to get there: vLLM's CPU backend keeps K transposed inside each (block, head),
and that copy runs at a third of memcpy's speed. A chunk such an engine writes is stored as its
blocks' memory instead (`BLOCKS_KT`, one code per block size), so that engine's loads are plain
copies; any other reader converts it to canonical (a copy, counted by the store), exactly: both
layouts hold the same elements, only their order differs.

`BLOCKS_KT | log2(block_size)` (block sizes 1 .. 32768, powers of two): per layer, per block of
`block_size` tokens, per KV head, K transposed `[dim, block_size]` then V `[block_size, dim]`:
`[layers, blocks, heads, 2 * block_size * dim]`, the memory of `block_size`-token blocks of vLLM's
CPU KV tensor `[blocks, heads, block_size, 2 * dim]`. Two planes (K and V); the header's shape stays
the canonical one and its token count is a multiple of the block size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentstate.errors import CorruptDataError, KVShapeError

if TYPE_CHECKING:
    import torch

    from agentstate.spec import ModelSpec

CANONICAL = 0
BLOCKS_KT = 0x10
"""vLLM's CPU block layout at rest: the code is `BLOCKS_KT | log2(block_size)`."""


def blocks_kt(block_size: int) -> int | None:
    """The layout code of `block_size`-token blocks with K transposed; None where the block size has
    none (not a power of two up to 32768): such an engine's chunks are stored canonical."""
    if type(block_size) is not int or block_size < 1 or block_size & (block_size - 1) or block_size > 1 << 15:
        return None
    return BLOCKS_KT | (block_size.bit_length() - 1)


def block_size_of(layout: int) -> int | None:
    """The block size of a BLOCKS_KT code; None for any other code."""
    return 1 << (layout & 0x0F) if layout & 0xF0 == BLOCKS_KT else None


def check_layout(layout: int, shape: tuple[int, ...]) -> None:
    """CorruptDataError unless `layout` is a known code that fits the canonical `shape`."""
    if layout == CANONICAL:
        return
    bs = block_size_of(layout)
    if bs is None:
        raise CorruptDataError(f"unknown layout code {layout:#x}")
    if shape[1] != 2 or shape[2] % bs:
        raise CorruptDataError(f"layout {layout:#x} needs K and V planes and whole blocks of {bs}, not shape {shape}")


def native_shape(layout: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The payload's own shape in `layout` (checked by `check_layout`) for canonical `shape`."""
    if layout == CANONICAL:
        return shape
    bs = block_size_of(layout)
    assert bs is not None
    layers, _, tokens, heads, dim = shape
    return (layers, tokens // bs, heads, 2 * bs * dim)


def planes_of(blocks: torch.Tensor, block_size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of BLOCKS_KT memory `[..., blocks, heads, 2 * block_size * dim]` as strided views
    `[..., blocks, block_size, heads, dim]`: no copy."""
    lead, (n, heads) = blocks.shape[:-3], blocks.shape[-3:-1]
    grid = blocks.unflatten(-1, (2, block_size * dim))
    k = grid[..., 0, :].unflatten(-1, (dim, block_size)).transpose(-1, -2)  # [..., n, heads, bs, dim]
    v = grid[..., 1, :].unflatten(-1, (block_size, dim))
    assert k.shape == (*lead, n, heads, block_size, dim)
    return k.transpose(-2, -3), v.transpose(-2, -3)


def to_canonical(payload: torch.Tensor, layout: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A canonical copy of a payload in native `layout` (already shaped `native_shape(layout, shape)`)."""
    import torch

    bs = block_size_of(layout)
    assert bs is not None
    layers, _, tokens, heads, dim = shape
    out = torch.empty(shape, dtype=payload.dtype, device=payload.device)
    k, v = planes_of(payload, bs, dim)  # [layers, blocks, bs, heads, dim]
    out[:, 0].view(layers, tokens // bs, bs, heads, dim).copy_(k)
    out[:, 1].view(layers, tokens // bs, bs, heads, dim).copy_(v)
    return out


@dataclass(frozen=True)
class NativeKV:
    """A chunk's KV in an engine's own layout, as the engine writes it: `data` shaped
    `native_shape(layout, shape)` (any strides), `shape` the canonical shape it stands for."""

    layout: int
    data: torch.Tensor
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def check(self, spec: ModelSpec, tokens: int) -> NativeKV:
        """Return self if it is `tokens` tokens of this spec's KV in a known layout, else KVShapeError."""
        if self.dtype != spec.torch_dtype or self.shape != spec.kv_shape(tokens):
            raise KVShapeError(f"native KV {self.shape} of {self.dtype} is not {spec.kv_shape(tokens)} of {spec.dtype}")
        try:
            check_layout(self.layout, self.shape)
        except CorruptDataError as exc:
            raise KVShapeError(str(exc)) from None
        if tuple(self.data.shape) != native_shape(self.layout, self.shape):
            raise KVShapeError(f"native data {tuple(self.data.shape)} is not {native_shape(self.layout, self.shape)}")
        return self
