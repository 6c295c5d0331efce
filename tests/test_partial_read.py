"""Reading the first tokens of a stored chunk (ChunkStore.read(..., stored=)): what a vLLM session
hit uses when the prompt leaves the session part way. KV of a token depends on the tokens before
it only, so the first n tokens of a chunk are the KV of any sequence that starts the same."""

from __future__ import annotations

import pytest
import torch

from agentstate import StateStore
from agentstate.errors import InvalidArgumentError
from agentstate.target import TensorTarget
from tests.conftest import SPEC4, bits_equal, random_kv, random_tokens


@pytest.mark.parametrize("cut", [1, 10, 63, 64, 100, 250, 299, 300])
async def test_a_session_read_part_way_is_bit_exact(store: StateStore, cut: int) -> None:
    toks, kv = random_tokens(300), random_kv(SPEC4, 300)  # 4 chunks of 64 and a tail of 44
    m = await store.snapshot("s", toks, kv)
    c = m.chunk_tokens
    keys, spans, stored = [], [], []
    for i, key in enumerate(m.chunk_keys):
        if i * c >= cut:
            break
        keys.append(key)
        spans.append((i * c, min(c, cut - i * c)))
        stored.append(c)
    if cut > len(m.chunk_keys) * c:
        keys.append(m.tail_key)
        spans.append((len(m.chunk_keys) * c, cut - len(m.chunk_keys) * c))
        stored.append(m.tail_tokens)
    out = torch.full(SPEC4.kv_shape(cut), float("nan"), dtype=SPEC4.torch_dtype)
    with store.chunks.pinned(keys):
        ok = await store.chunks.read(keys, spans, TensorTarget(out, SPEC4), stored=stored)
    assert all(ok) and bits_equal(out, kv[:, :, :cut])


async def test_a_span_longer_than_its_chunk_is_refused(store: StateStore) -> None:
    m = await store.snapshot("s", random_tokens(100), random_kv(SPEC4, 100))
    out = torch.empty(SPEC4.kv_shape(64), dtype=SPEC4.torch_dtype)
    with store.chunks.pinned(m.chunk_keys):
        for stored in ([32], [64, 64]):
            with pytest.raises(InvalidArgumentError):
                await store.chunks.read(m.chunk_keys, [(0, 64)], TensorTarget(out, SPEC4), stored=stored)
