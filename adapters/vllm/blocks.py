"""How the vLLM connector reads and writes the engine's KV blocks (no vLLM import): block layouts,
the block target, and the copies between canonical chunks and blocks.

Block layouts. vLLM keeps one KV tensor per attention layer, in a layout each attention backend
chooses. Stored chunks are canonical (`[layers, planes, tokens, heads, dim]`); a `BlockLayout`
turns one layer's tensor into two strided views `[num_blocks, block_size, heads, dim]` (K and V)
over the same memory, so a restore copies straight into the engine's blocks and a save copies
straight out of them: no intermediate tensor in the engine's layout. Chosen from what the engine
reports (the backend's name; on CPU the kernel ISA), by `layout_for`:

- `cpu_vec`: vLLM's CPU backend with its AVX-512/vec kernels, `[blocks, heads, block_size,
  2 * dim]` where inside one (block, head) K is stored transposed `[dim, block_size]`, then V
  `[block_size, dim]`. Tested against the engine.
- `flash_nhd` / `flash_hnd`: the CUDA flash-attention family, `[2, blocks, block_size, heads,
  dim]` (NHD), or its HND stride order. Written from vLLM's documented shape; tests marked `gpu`.

Anything else (AMX's VNNI packing, MLA, quantized KV) is refused: the connector then stays off
rather than store bytes it cannot read back.

Native chunks. `cpu_vec` blocks are stored as they lie in memory (agentstate.layouts `BLOCKS_KT`,
where the block size is a power of two): K lies transposed there, and the transposing copy to and
from canonical KV runs at a third of memcpy's speed, so the engine's own loads of its own chunks
become plain copies (one per layer and run of consecutive blocks). Other readers (transformers, a
vLLM with another layout) get canonical KV converted from them, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentstate.adapters.vllm.groups import NULL_BLOCK
from agentstate.errors import InvalidArgumentError
from agentstate.layouts import NativeKV, blocks_kt, planes_of
from agentstate.target import GuardedTarget

# -- layouts ---------------------------------------------------------------------------------------

Orders = tuple[tuple[int, int, int], tuple[int, int, int]]
IDENTITY: Orders = ((0, 1, 2), (0, 1, 2))


@dataclass(frozen=True)
class BlockLayout:
    """How one layer's KV tensor is blocks of K and V, as two strided views `[blocks, bs, heads, dim]`."""

    name: str
    block_size: int
    heads: int
    dim: int

    @property
    def orders(self) -> Orders:
        """Dim orders of `[tokens, heads, dim]` (K, V) in which the engine's memory is contiguous: copies
        iterate that way (a transposing copy walked in the other order is ~10x slower on CPU)."""
        if self.name == "cpu_vec":
            return (1, 2, 0), (1, 0, 2)
        if self.name == "flash_hnd":
            return (1, 0, 2), (1, 0, 2)
        return (0, 1, 2), (0, 1, 2)

    @property
    def native_code(self) -> int | None:
        """The chunk layout these blocks are stored in at rest (agentstate.layouts), None: canonical."""
        return blocks_kt(self.block_size) if self.name == "cpu_vec" else None

    def planes(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs, h, d = self.block_size, self.heads, self.dim
        if self.name == "cpu_vec":
            if layer.dim() != 4 or tuple(layer.shape[1:]) != (h, bs, 2 * d):
                raise InvalidArgumentError(f"CPU KV tensor {tuple(layer.shape)} is not [blocks, {h}, {bs}, {2 * d}]")
            # K^T inside (block, head): the layout chunks keep at rest too. view, never a copy: these
            # planes must be the engine's memory
            return planes_of(layer.view(layer.shape[0], h, 2 * bs * d), bs, d)
        if self.name in ("flash_nhd", "flash_hnd"):
            if layer.dim() != 5 or layer.shape[0] != 2:
                raise InvalidArgumentError(f"flash-attention KV tensor {tuple(layer.shape)} is not [2, blocks, ...]")
            if self.name == "flash_nhd":
                if tuple(layer.shape[2:]) != (bs, h, d):
                    raise InvalidArgumentError(f"KV tensor {tuple(layer.shape)} is not [2, blocks, {bs}, {h}, {d}]")
                return layer[0], layer[1]
            if tuple(layer.shape[2:]) != (h, bs, d):
                raise InvalidArgumentError(f"KV tensor {tuple(layer.shape)} is not [2, blocks, {h}, {bs}, {d}]")
            return layer[0].transpose(1, 2), layer[1].transpose(1, 2)
        raise InvalidArgumentError(f"unknown block layout {self.name!r}")


SUPPORTED = {
    ("CPU_ATTN", "vec"): "cpu_vec",
    ("FLASH_ATTN", "NHD"): "flash_nhd",
    ("FLASH_ATTN", "HND"): "flash_hnd",
}


def layout_for(backend: str, variant: str, *, block_size: int, heads: int, dim: int) -> BlockLayout:
    """The converter for an attention backend (`get_name()`) and its variant (CPU: the kernel ISA;
    CUDA: the KV cache layout NHD/HND); InvalidArgumentError for layouts not supported."""
    name = SUPPORTED.get((backend, variant))
    if name is None:
        raise InvalidArgumentError(
            f"attention backend {backend} ({variant}) stores KV in a layout agentstate cannot convert"
            f" (supported: {sorted(SUPPORTED)})"
        )
    return BlockLayout(name, block_size, heads, dim)


# -- moving tokens between canonical chunks and blocks ----------------------------------------------


class BlocksTarget(GuardedTarget):
    """A restore lands in the engine's blocks: token `t` of the sequence is slot `t % bs` of block
    `block_ids[t // bs]`, in every layer. Tokens before `first` are not written (vLLM holds them
    already: its own prefix cache hit, which other requests may be reading), nor tokens from
    `stop` on (a session's tail may run past what vLLM loads: it computes the last prompt token).

    After `close()` returns nothing writes any more (a load that timed out hands its blocks back);
    it returns the start tokens of the spans written in full.
    """

    def __init__(
        self, planes: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], block_size: int, first: int,
        num_tokens: int, orders: Orders = IDENTITY, stop: int | None = None,
        native: tuple[int, list[torch.Tensor]] | None = None, per_layer: list[list[int]] | None = None,
    ) -> None:  # fmt: skip
        """`native`: (layout code, the layers' own tensors) where chunks of that layout copy as they are;
        `per_layer`: a hybrid model's block ids per layer (its group's), null blocks skipped."""
        super().__init__()
        self.per_layer = per_layer
        self.state_placed = False  # a Mamba model's load: its state went into its block
        self.planes = planes
        self.native_layout, self.layers = native if native is not None else (None, [])
        self.stop = num_tokens if stop is None else stop
        self.orders = orders
        self.block_ids = block_ids
        self.block_size = block_size
        self.first = first
        self.num_tokens = num_tokens
        self.device = planes[0][0].device

    def _place(self, start: int, src: torch.Tensor) -> int:
        scatter(self.planes, self.block_ids, self.block_size, start, src[:, :, : max(0, self.stop - start)],
                first=self.first, orders=self.orders, per_layer=self.per_layer)  # fmt: skip
        return start

    def _place_native(self, start: int, n: int, src: NativeKV) -> int:
        """A chunk in the blocks' own layout: whole blocks are one contiguous copy per layer and run of
        consecutive block ids; a partial block (at `first` or `stop`) copies its slots through the
        same strided views on both sides."""
        bs, dim = self.block_size, src.shape[4]
        for b, count, lo, hi in _runs(self.block_ids, bs, start, min(n, max(0, self.stop - start)), self.first):
            j = (lo - start) // bs  # the run's first block within the chunk
            if hi - lo == count * bs:
                for layer, data in zip(self.layers, src.data):
                    layer[b : b + count].copy_(data[j : j + count].view(layer[b : b + count].shape))
                continue
            a, z = lo % bs, lo % bs + (hi - lo)  # slots of one partial block
            for (k, v), data in zip(self.planes, src.data):
                k_src, v_src = planes_of(data[j : j + 1], bs, dim)
                k[b, a:z].copy_(k_src[0, a:z])
                v[b, a:z].copy_(v_src[0, a:z])
        return start


class EngineBlocks:
    """The engine's registered KV caches, one `(K, V)` pair of block views per layer in one layout:
    what loads write into and saves copy out of. A hybrid model's also know each attention layer's KV
    cache group and the Mamba layers' state tensors (`groups.py`)."""

    def __init__(
        self, layout: BlockLayout, planes: list[tuple[torch.Tensor, torch.Tensor]], layers: list[torch.Tensor] | None = None,
        layer_groups: list[int] | None = None, states: dict[str, torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        """`layers`: the engine's own per-layer tensors, for native chunks (`layout.native_code`);
        `layer_groups`: each layer's KV cache group (a hybrid model's; its chunks stay canonical);
        `states`: the state layout's tensors by name, `[blocks, ...]` each (a Mamba layer's, as bound)."""
        self.layout = layout
        self.planes = planes
        self.layers = layers or []
        self.layer_groups = layer_groups
        self.states = states or {}
        hybrid = layer_groups is not None
        self.native_code = layout.native_code if self.layers and not self.is_cuda and not hybrid else None

    def per_layer(self, groups: list[list[int]] | None) -> list[list[int]] | None:
        """Each layer's block ids (its group's) of a request's per-group block ids; None for one group."""
        if self.layer_groups is None or groups is None:
            return None
        return [groups[g] for g in self.layer_groups]

    def state_at(self, block: int) -> dict[str, torch.Tensor]:
        """The Mamba layers' state held in `block`, copied out (the block goes back to vLLM soon)."""
        return {name: t[block].clone() for name, t in self.states.items()}

    def put_state(self, block: int, state: dict[str, torch.Tensor]) -> None:
        """Copy a stored state into `block` of every Mamba layer."""
        for name, t in self.states.items():
            t[block].copy_(state[name])

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def is_cuda(self) -> bool:
        return bool(self.planes) and self.planes[0][0].is_cuda

    def target(
        self, block_ids: list[int], first: int, num_tokens: int, stop: int, groups: list[list[int]] | None = None
    ) -> BlocksTarget:
        """Where a load of tokens `first .. stop` into these blocks lands (spans may run on to `num_tokens`);
        `groups`: a hybrid model's block ids per KV cache group."""
        native = (self.native_code, self.layers) if self.native_code is not None else None
        return BlocksTarget(self.planes, block_ids, self.block_size, first, num_tokens, orders=self.layout.orders,
                            stop=stop, native=native, per_layer=self.per_layer(groups))  # fmt: skip

    def gather(
        self, block_ids: list[int], n: int, out: torch.Tensor, groups: list[list[int]] | None = None
    ) -> torch.Tensor:
        """Canonical KV of the first `n` tokens of these blocks, copied into `out` (`groups`: as `target`)."""
        return gather(self.planes, block_ids, self.block_size, 0, n, out, self.layout.orders, self.per_layer(groups))

    def gather_native(self, block_ids: list[int]) -> torch.Tensor:
        """These whole blocks as they lie in memory, `[layers, blocks, heads, 2 * block_size * dim]`
        (`native_code`'s payload): one contiguous copy per layer and run of consecutive ids."""
        first = self.layers[0]
        out = torch.empty((len(self.layers), len(block_ids), *first.shape[1:]), dtype=first.dtype)
        for b, count, lo, _ in _runs(block_ids, self.block_size, 0, len(block_ids) * self.block_size, 0):
            j = lo // self.block_size
            for layer, dst in zip(self.layers, out):
                dst[j : j + count].copy_(layer[b : b + count])
        return out.flatten(3)


def _runs(
    block_ids: list[int], block_size: int, start: int, n: int, first: int, skip_null: bool = False
) -> list[tuple[int, int, int, int]]:
    """(first block id, block count, token lo, token hi) covering tokens `start .. start+n` at or
    after `first`: whole blocks with consecutive ids merge into one run (one strided copy per layer
    and plane instead of one per block: per-call overhead dominates small models), a partial block
    at either end is a run of its own. `skip_null`: tokens in vLLM's null block (a hybrid model's
    group keeps nothing there: outside a sliding window) are left out."""
    out: list[tuple[int, int, int, int]] = []
    lo = max(start, first)
    while lo < start + n:
        j = lo // block_size
        hi = min(start + n, (j + 1) * block_size)
        b = block_ids[j]
        if skip_null and b == NULL_BLOCK:
            lo = hi
            continue
        whole = lo == j * block_size and hi == (j + 1) * block_size
        if out and whole:
            b0, count, lo0, hi0 = out[-1]
            if b0 + count == b and lo0 % block_size == 0 and hi0 == lo:
                out[-1] = (b0, count + 1, lo0, hi)
                lo = hi
                continue
        out.append((b, 1, lo, hi))
        lo = hi
    return out


def _pair(
    plane: torch.Tensor, canon: torch.Tensor, run: tuple[int, int, int, int], block_size: int, order: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's blocks in `plane` and its tokens in `canon` (`[tokens, heads, dim]`, the run's
    tokens only), as two equal-shaped views permuted to `order`: a run of whole blocks is
    `[blocks, bs, heads, dim]` on both sides (splitting the canonical token dim is always a view;
    merging the engine's block and slot dims is not)."""
    b, count, lo, hi = run
    if count == 1:
        off = (lo // block_size) * block_size
        return plane[b, lo - off : hi - off].permute(order), canon.permute(order)
    order4 = (0, *(d + 1 for d in order))
    return plane[b : b + count].permute(order4), canon.unflatten(0, (count, block_size)).permute(order4)


# K of the CPU layout lies transposed (`[dim, block_size]` per block and head). A direct strided copy
# into it reads canonical K with a stride of one token (heads * dim elements); from ~1 KiB strides on
# it is faster staged through a head-major scratch `[blocks, heads, bs, dim]` (a copy of dim-long
# runs, then a batched transpose of contiguous matrices): 8 heads x 128 dim, bf16, 12 -> 8 ms per
# 8 MiB, fp32 18 -> 12.5 ms; below it (small models) the direct copy wins. Copies out of the blocks
# (saves, off the step) showed no steady gain from staging and stay direct.
TRANSPOSED_K = (1, 2, 0)
STAGE_FROM_BYTES = 1024


def _stage(run: tuple[int, int, int, int], block_size: int, order: tuple[int, ...], src: torch.Tensor) -> bool:
    """Whether this run of whole blocks gets the staged K copy."""
    whole = run[3] - run[2] == run[1] * block_size
    return order == TRANSPOSED_K and whole and src.stride(2) * src.element_size() >= STAGE_FROM_BYTES


def by_group(layers: int, block_ids: list[int], per_layer: list[list[int]] | None) -> list[tuple[list[int], list[int], bool]]:
    """(block ids, layer indices, skip null blocks) per KV cache group: one group of every layer, or,
    for a hybrid model (`per_layer`: each layer's group's block ids), the layers sharing block ids."""
    if per_layer is None:
        return [(block_ids, list(range(layers)), False)]
    found: dict[int, tuple[list[int], list[int], bool]] = {}
    for i, ids in enumerate(per_layer):
        found.setdefault(id(ids), (ids, [], True))[1].append(i)
    return list(found.values())


def scatter(
    planes: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], block_size: int, start: int,
    src: torch.Tensor, *, first: int = 0, orders: Orders = IDENTITY, per_layer: list[list[int]] | None = None,
) -> None:  # fmt: skip
    """Copy canonical `src` (tokens `start ..`) into the blocks, one strided copy per (layer, plane, run);
    `per_layer`: each layer's own block ids (a hybrid model's groups; null blocks are skipped)."""
    for ids, layers, skip in by_group(len(planes), block_ids, per_layer):
        _scatter(planes, layers, ids, block_size, start, src, first, orders, skip)


def _scatter(
    planes: list[tuple[torch.Tensor, torch.Tensor]], layers: list[int], block_ids: list[int], block_size: int,
    start: int, src: torch.Tensor, first: int, orders: Orders, skip_null: bool,
) -> None:  # fmt: skip
    ko, vo = orders
    for run in _runs(block_ids, block_size, start, src.shape[2], first, skip_null):
        lo, hi = run[2] - start, run[3] - start
        b, count = run[0], run[1]
        scratch = None
        for layer in layers:
            k, v = planes[layer]
            if _stage(run, block_size, ko, src):
                part = src[layer, 0, lo:hi].unflatten(0, (count, block_size)).permute(0, 2, 1, 3)
                if scratch is None:
                    scratch = torch.empty(part.shape, dtype=part.dtype, device=part.device)
                scratch.copy_(part)  # [blocks, heads, bs, dim]
                k[b : b + count].permute(0, 2, 3, 1).copy_(scratch.transpose(2, 3))  # [blocks, heads, dim, bs]
            else:
                dst, part = _pair(k, src[layer, 0, lo:hi], run, block_size, ko)
                dst.copy_(part)
            dst, part = _pair(v, src[layer, 1, lo:hi], run, block_size, vo)
            dst.copy_(part)


def gather(
    planes: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], block_size: int, start: int, n: int,
    out: torch.Tensor, orders: Orders = IDENTITY, per_layer: list[list[int]] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Canonical KV `[layers, 2, n, heads, dim]` of tokens `start .. start+n`, copied out of the blocks
    (`per_layer`: each layer's own block ids, none of them null: a save plans only chunks held whole)."""
    ko, vo = orders
    for ids, layers, _ in by_group(len(planes), block_ids, per_layer):
        if per_layer is not None and NULL_BLOCK in ids[start // block_size : -(-(start + n) // block_size)]:
            raise InvalidArgumentError(f"tokens {start}..{start + n} are no longer in the engine's blocks (a null block)")
        for run in _runs(ids, block_size, start, n, 0):
            lo, hi = run[2] - start, run[3] - start
            for layer in layers:
                k, v = planes[layer]
                blocks, dst = _pair(k, out[layer, 0, lo:hi], run, block_size, ko)
                dst.copy_(blocks)
                blocks, dst = _pair(v, out[layer, 1, lo:hi], run, block_size, vo)
                dst.copy_(blocks)
    return out
