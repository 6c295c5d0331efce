"""Chunks across tensor-parallel sizes: one prefix, one digest, one key per slice of heads.

A chunk's digest chain starts from the model's fingerprint (every KV head, TP size 1:
`ModelSpec.model_fingerprint`), and its key's spec segment names the slice of heads its value holds:
`c/<slice fingerprint>/<digest>`. At TP size 1 the two are the same spec, so nothing stored before
changes name. A rank at TP size n writes and reads its own slice: exactly its bytes, no gather, no
rank waiting on another.

When a chunk is missing in the reader's slicing but another TP size stored it (the whole chunk from
TP 1, halves from TP 2, ...), `find` names the stored slices that together hold the reader's heads and
`gather` reads them (each checked against its own slice's spec and key), copies out the reader's heads
(bit-exact: a slice of heads is a copy, nothing is recomputed) and returns them as canonical KV, which
the store then keeps under the reader's own key: the next read is a plain one. A reader at TP n of
a whole chunk fetches n times the bytes it keeps, once.

Nothing here writes: the store decides what to keep (`StateStore`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentstate.keys import respec
from agentstate.spec import ModelSpec

if TYPE_CHECKING:
    import torch

    from agentstate.chunks import ChunkStore, Span
    from agentstate.target import KVTarget

log = logging.getLogger("agentstate.slices")

MAX_PARTS = 8
"""The most slices one chunk is assembled from (a reader at TP 1 of chunks a TP 8 engine stored): a
lookup asks about every part of every candidate slicing, so the candidates stop here."""


@dataclass(frozen=True)
class Source:
    """Where chunk `index` of a lookup is stored in another slicing: `keys[j]` holds `parts[j]`'s heads."""

    index: int
    parts: tuple[ModelSpec, ...]
    keys: tuple[str, ...]


def slicings(spec: ModelSpec) -> list[list[ModelSpec]]:
    """The other slicings whose slices hold `spec`'s heads (`ModelSpec.sources`), at most `MAX_PARTS` each."""
    return [parts for parts in spec.sources() if len(parts) <= MAX_PARTS]


async def find(chunks: ChunkStore, spec: ModelSpec, keys: Sequence[str], start: int) -> list[Source]:
    """For `keys[start:]` (chunk keys of `spec`'s slicing that no tier holds), the leading run that
    another slicing holds, the fewest bytes first. Only a shared (remote) tier can hold them: a data
    directory is one spec's. Asks about the first missing chunk alone before the rest: a fleet of one
    TP size pays one small lookup per miss."""
    families = slicings(spec)
    if start >= len(keys) or not families or not chunks.shared:
        return []
    found = await _sources(chunks, spec, families, keys, start, start + 1)
    if not found:
        return []
    found += await _sources(chunks, spec, families, keys, start + 1, len(keys))
    return found


async def _sources(
    chunks: ChunkStore, spec: ModelSpec, families: list[list[ModelSpec]], keys: Sequence[str], start: int, end: int
) -> list[Source]:
    asked = {
        i: [[respec(keys[i], spec.fingerprint, part.fingerprint) for part in parts] for parts in families]
        for i in range(start, end)
    }
    flat = list(dict.fromkeys(k for options in asked.values() for names in options for k in names))
    present = dict(zip(flat, await chunks.present(flat)))
    found: list[Source] = []
    for i in range(start, end):
        for parts, names in zip(families, asked[i]):
            if all(present[k] for k in names):
                found.append(Source(i, tuple(parts), tuple(names)))
                break
        else:
            break
    return found


async def gather(chunks: ChunkStore, spec: ModelSpec, sources: Sequence[Source], tokens: int) -> list[torch.Tensor]:
    """The KV of `spec`'s heads of each source's chunk (`tokens` tokens), read from the slices that
    hold them; stops at the first chunk a part of which did not arrive intact (missing, corrupt)."""
    import torch

    first, end = spec.head_range
    out = [torch.empty(spec.kv_shape(tokens), dtype=spec.torch_dtype) for _ in sources]
    ok = [[False] * len(s.parts) for s in sources]
    by_spec: dict[ModelSpec, list[tuple[int, int]]] = {}
    for i, source in enumerate(sources):
        for j, part in enumerate(source.parts):
            by_spec.setdefault(part, []).append((i, j))
    for part, places in by_spec.items():
        a, b = part.head_range
        lo, hi = max(a, first), min(b, end)

        def deliver(
            n: int, kv: torch.Tensor, places: list[tuple[int, int]] = places, a: int = a, lo: int = lo, hi: int = hi
        ) -> None:
            i, _ = places[n]
            out[i][:, :, :, lo - first : hi - first].copy_(kv[:, :, :, lo - a : hi - a])

        keys = [sources[i].keys[j] for i, j in places]
        with chunks.pinned(keys):
            got = await chunks.read_as(part, keys, [tokens] * len(keys), deliver)
        for (i, j), good in zip(places, got):
            ok[i][j] = good
    n = next((i for i, parts in enumerate(ok) if not all(parts)), len(sources))
    if n < len(sources):
        log.warning("%d of %d chunks stored at another TP size did not arrive intact", len(sources) - n, len(sources))
    return out[:n]


def holder(spec: ModelSpec, fingerprint: str) -> ModelSpec | None:
    """The slicing of `spec`'s model named `fingerprint` if one slice of it holds every head of `spec`'s
    (the whole model, or a wider slice: what a session stored at a smaller TP size gives this rank),
    else None. A session is one manifest per writer: slices of several writers are never assembled."""
    if fingerprint == spec.fingerprint:
        return None
    for parts in slicings(spec):
        if len(parts) == 1 and parts[0].fingerprint == fingerprint:
            return parts[0]
    return None


async def read_into(
    chunks: ChunkStore, source: ModelSpec, spec: ModelSpec, keys: Sequence[str], spans: Sequence[Span],
    target: KVTarget, lossy: set[str] | None = None,
) -> list[bool]:  # fmt: skip
    """Restore `keys` (values of `source`, a slicing holding `spec`'s heads) into `target` at `spans`,
    `spec`'s heads only: a session's chunks and tail stored at another TP size. Keys must be pinned."""
    first, end = spec.head_range
    a = source.head_range[0]

    def deliver(i: int, kv: torch.Tensor) -> None:
        start, n = spans[i]
        target.write(start, kv[:, :, :n, first - a : end - a])

    return await chunks.read_as(source, keys, [n for _, n in spans], deliver, lossy)
