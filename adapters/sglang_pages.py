"""Helpers of the SGLang HiCache adapter: its settings, page layouts, the page target.

Kept apart from `agentstate.adapters.sglang` so that the parts that need no SGLang import (and
are the ones worth reading first) stay small: how an engine page becomes canonical KV. What every
adapter shares (settings base, loop thread, never-raise guard) is `agentstate.adapters.runtime`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field

from agentstate import codec
from agentstate.adapters import SGLANG_PAGES
from agentstate.adapters.runtime import AdapterSettings
from agentstate.errors import InvalidArgumentError
from agentstate.memory import Buffer, host_buffer
from agentstate.spec import DTYPE_NAMES, ModelSpec, StateLayout, StateTensor
from agentstate.target import GuardedTarget

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"})
"""Keys of SGLang's dynamic-backend extra config that belong to SGLang, not to the store."""
_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@-]{0,255}")


class SglangSettings(AdapterSettings):
    """The adapter's own keys of `--hicache-storage-backend-extra-config`; all other keys
    (`tiers`, `host_capacity_bytes`, `write_policy`, ...) go to `StoreConfig` unchanged.

    `config_file` (else env AGENTSTATE_CONFIG_FILE) adds a config file (docs/config.md): its
    StoreConfig keys under the env vars, under the inline keys; its `[sglang]` table (`[vllm]` for
    the vLLM connector) holds these keys, under the inline ones; its `path` is the data root unless
    one is given here."""

    table: ClassVar[str] = "sglang"
    engine_keys: ClassVar[frozenset[str]] = SGLANG_KEYS

    path: Path = Field(default=Path("agentstate-hicache"), description="data root; one directory per rank below it")
    model_id: str | None = Field(default=None, description="overrides SGLang's model name in the fingerprint")
    timeout_s: float = Field(default=60.0, gt=0, description="longest one SGLang call waits for the store")

def size_of(items: object) -> int:
    try:
        return len(items)  # type: ignore[arg-type]
    except TypeError:
        return 0


def encode_page(
    page: torch.Tensor, fingerprint: str, key: str, buffer: Callable[[int], Buffer] = host_buffer
) -> Buffer:
    """One canonical page as a codec value bound to `key`, the storage key it is put under; the
    encode is the one copy out of pool memory, into `buffer(n)` (the store's: its host tier's arena)."""
    return codec.encode(page, fingerprint, key=key, out=buffer(codec.encoded_size(page.numel() * page.element_size())))


def valid_key(key: object) -> bool:
    """SGLang page keys are hex hashes (plus dotted suffixes); anything else is refused, never stored."""
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None


@dataclass(frozen=True)
class PageLayout:
    """How one page of a host pool is canonical KV `[layers, planes, page_size, heads, dim]`.

    `page.view(shape).permute(perm)` is canonical for a page as the pool hands it out, both the
    non-flat view `get_data_page(i, flat=False)` (pool memory itself) and the flat page of the
    generic interface (same element order). Only views, never copies: a restore that writes
    into the canonical view writes the pool. Stored pages are canonical, so a page stored from a
    `page_first` pool loads into a `layer_first` one.
    """

    layout: str
    page_size: int
    planes: int
    heads: int
    dim: int
    layers: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    perm: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.layers * self.planes * self.page_size * self.heads * self.dim

    def canonical(self, page: torch.Tensor) -> torch.Tensor:
        if page.dtype != self.dtype or page.numel() != self.numel:
            raise InvalidArgumentError(
                f"page of {page.dtype} x {page.numel()} is not one {self.dtype} x {self.numel} page"
            )
        return page.view(self.shape).permute(self.perm)

    def pool_view(self, pool: Any) -> torch.Tensor | None:
        """Canonical KV of the whole pool, `[layers, planes, slots, heads, dim]`, as one view, where
        the layout keeps a token's slots on one dim (`layer_first`, `page_first`): a page is then
        `narrow(2, start, page_size)` of it, one cheap op instead of SGLang's per-page slicing
        plus a reshape (about a fifth of a 64-page read's CPU time went to building those views).

        None where the layout has no such view, or where the view does not give exactly the memory
        SGLang's own `get_data_page` gives for the first and last page (checked here, so a pool
        whose buffer is not what this expects costs speed, never a wrong page)."""
        if self.layout not in ("layer_first", "page_first"):
            return None
        try:
            buffer, size, ps = pool.kv_buffer, int(pool.size), self.page_size
            t = self.perm[2]  # the buffer's token dim (canonical dim 2 is buffer dim perm[2])
            whole = self.shape[:t] + (size,) + self.shape[t + 1 :]
            if not isinstance(buffer, torch.Tensor) or size < ps or tuple(buffer.shape) != whole:
                return None
            view = buffer.permute(self.perm)
            for start in (0, (size // ps - 1) * ps):
                theirs = self.canonical(pool.get_data_page(start, flat=False))
                mine = view.narrow(2, start, ps)
                if (mine.data_ptr(), mine.shape, mine.stride()) != (theirs.data_ptr(), theirs.shape, theirs.stride()):
                    return None
            return view
        except (AttributeError, TypeError, ValueError, RuntimeError, InvalidArgumentError):
            return None

    @classmethod
    def of(cls, pool: Any) -> PageLayout:
        """The layout of an SGLang host pool (MHA: 4 layouts; MLA: 3), from its public attributes."""
        layers, ps, layout = int(pool.layer_num), int(pool.page_size), str(pool.layout)
        if hasattr(pool, "kv_cache_dim"):  # MLA: one latent plane, one "head"
            planes, heads, dim = 1, 1, int(pool.kv_cache_dim)
            table = {
                "layer_first": ((layers, 1, ps, 1, dim), (0, 1, 2, 3, 4)),
                "page_first": ((1, ps, layers, 1, dim), (2, 0, 1, 3, 4)),
                "page_first_direct": ((layers, 1, ps, 1, dim), (0, 1, 2, 3, 4)),
            }
        elif hasattr(pool, "head_num") and getattr(pool, "v_head_dim", pool.head_dim) == pool.head_dim:
            planes, heads, dim = 2, int(pool.head_num), int(pool.head_dim)
            table = {
                "layer_first": ((2, layers, ps, heads, dim), (1, 0, 2, 3, 4)),
                "page_first": ((2, ps, layers, heads, dim), (2, 0, 1, 3, 4)),
                "page_first_direct": ((2, layers, ps, heads, dim), (1, 0, 2, 3, 4)),
                "page_head": ((2, heads, ps, layers, dim), (3, 0, 2, 1, 4)),
            }
        else:
            raise InvalidArgumentError(f"host pool {type(pool).__name__} is neither MHA (K and V of one width) nor MLA")
        if layout not in table:
            raise InvalidArgumentError(f"host pool layout {layout!r} is not supported (supported: {sorted(table)})")
        shape, perm = table[layout]
        return cls(layout, ps, planes, heads, dim, layers, pool.dtype, shape, perm)

    def spec(self, model_id: str, revision: str, tp_rank: int, tp_size: int) -> ModelSpec:
        if self.dtype not in DTYPE_NAMES:
            raise InvalidArgumentError(
                f"host pool dtype {self.dtype} cannot be stored (supported: {sorted(DTYPE_NAMES.values())})"
            )
        return ModelSpec(
            model_id=model_id, revision=revision, dtype=DTYPE_NAMES[self.dtype], num_layers=self.layers,
            kv_planes=self.planes, num_kv_heads=self.heads, head_dim=self.dim, tp_rank=tp_rank, tp_size=tp_size,
        )  # fmt: skip


class PagesTarget(GuardedTarget):
    """Restored pages land straight in host-pool memory: chunk `i` of a read is page `pages[i]`.

    After `close()` returns nothing writes into the pool any more: a call that timed out hands
    its pages back to SGLang, which may reuse them at once, while reads may still be running.
    `close()` returns the indices of the pages written in full.
    """

    def __init__(self, pages: list[torch.Tensor], page_size: int) -> None:
        super().__init__()
        self.pages = pages
        self.page_size = page_size
        self.num_tokens = len(pages) * page_size
        self.device = torch.device("cpu")

    def _place(self, start: int, src: torch.Tensor) -> int:
        self.pages[start // self.page_size].copy_(src)
        return start // self.page_size


@dataclass(frozen=True)
class ExtraPool:
    """One extra host pool of a hybrid model, as SGLang's v2 interface registers it (`mamba`: one
    state per slot, kept at a radix node's last page; `swa`: a sliding window's token pages; a
    sidecar). A page is the pool's own flat bytes (`get_data_page(slot, flat=True)`), stored as one
    uint8 value of a spec of its own: the model's spec with that page as its state layout (named
    after the pool), so a pool that lays its pages out otherwise or holds other bytes never reads
    these. Its values live under the same page keys in that spec's page space (`prefix`), apart from
    the KV pages: what `verify` of the rank's directory checks is the KV."""

    name: str
    pool: Any
    spec: ModelSpec  # the uint8 spec a page is encoded in
    nbytes: int
    dtype: torch.dtype  # of the pool's flat pages
    prefix: str

    @classmethod
    def of(cls, name: str, pool: Any, kv_spec: ModelSpec, page_size: int, shard: str) -> ExtraPool:
        """InvalidArgumentError for a pool whose pages cannot be read as flat bytes (startup)."""
        try:
            page = pool.get_dummy_flat_data_page()
            per = int(pool.page_size)
            int(pool.size)
        except Exception as exc:  # noqa: BLE001 - anything SGLang's pool raises: refused at attach
            raise InvalidArgumentError(f"extra host pool {name!r} has no flat pages: {exc}") from None
        nbytes = page.numel() * page.element_size()
        if not isinstance(page, torch.Tensor) or nbytes <= 0 or per <= 0 or not re.fullmatch(r"[a-z0-9_]{1,64}", name):
            raise InvalidArgumentError(f"extra host pool {name!r}: pages of {nbytes} bytes, {per} slots each")
        layout = StateLayout(tensors=(StateTensor(name=f"sglang.{name}", shape=(nbytes,), dtype="uint8"),))
        spec = kv_spec.model_copy(update={"state": layout}).state_spec
        assert spec is not None
        return cls(name, pool, spec, nbytes, page.dtype, f"{SGLANG_PAGES.prefix}{spec.fingerprint}/{page_size}/{shard}/")

    def key(self, key: str) -> str:
        return self.prefix + key

    def slots(self, keys: list[str], host_indices: Any) -> list[int] | None:
        """The host slot of each key's page (`host_indices[i * page_size]`), None unless the indices
        are one page per key, each page inside the pool."""
        indices = torch.as_tensor(host_indices).flatten()
        per, size = int(self.pool.page_size), int(self.pool.size)
        if indices.numel() != len(keys) * per:
            return None
        slots = [int(s) for s in indices[::per].tolist()]
        return slots if all(0 <= s < size and s % per == 0 for s in slots) else None

    def page(self, slot: int) -> torch.Tensor:
        """A copy of the page at `slot`, as the value's `(1, 1, nbytes, 1, 1)` uint8 payload."""
        raw = self.pool.get_data_page(slot, flat=True).contiguous().view(torch.uint8).reshape(-1).clone()
        if raw.numel() != self.nbytes:
            raise InvalidArgumentError(f"pool {self.name} page of {raw.numel()} bytes, {self.nbytes} expected")
        return raw.view(1, 1, -1, 1, 1)

    def put(self, slot: int, page: torch.Tensor) -> None:
        """Copy a stored page (checked, `nbytes` long) into the pool's `slot`."""
        self.pool.set_from_flat_data_page(slot, page.reshape(-1).view(self.dtype))
