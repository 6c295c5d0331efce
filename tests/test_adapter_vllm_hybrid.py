"""The vLLM connector on a hybrid model: a real vLLM engine on CPU running a tiny random Qwen3-Next
(GatedDeltaNet layers between full-attention ones, bf16) with its hybrid memory allocator on.

vLLM gives such a model two KV cache groups (the GDN layers' states, the attention layers' KV), and
widens the attention blocks to a GDN state's page (288 tokens here), so chunks are 288 tokens: each
holds the attention layers' KV, and where a step ends on a chunk's end the GDN layers' state there is
stored beside it (a boundary). Engine runs, one request per `generate` call and the prefix cache reset
between rounds (only the connector can supply hits); the reference tokens are the same prompts computed
cold in the same engine, each under a cache_salt of its own (nothing stored there, vLLM's cache keyed
apart):

- conn: H1 stored (two chunks, a boundary at 576), then hit (chunks and state loaded); H2 (shares
  H1's 576 tokens) hit and stored on to 864 (its step after the load ends there); H1 as session
  `hybrid-1`, snapshotted with its state when it finishes, and its next turn loading all of it; then,
  with the engine gone, the library reads what it wrote and the state at 864 is damaged on disk;
- again: a new engine on the same directory: H2's planned hit finds the damaged state, the load
  fails as a whole request and vLLM recomputes it (tokens equal the reference); the state written
  by that recompute then serves H2 to 864; H1 still hits at 576;
- a Gemma 3 (sliding windows) engine: prefixes hit with every attention layer loaded.

Runs under the venv that has vLLM (.ci/run makes .venv-vllm); CI fails instead of skipping.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.requires import require_module

vllm = require_module("vllm", "pip install -c constraints.txt -r requirements-vllm.txt (a venv of its own: .ci/run)")

from agentstate import ModelSpec, StateStore
from agentstate.config import StoreConfig
from agentstate.datadir import recorded_config
from agentstate.errors import InvalidArgumentError
from agentstate.keys import boundary_key, chunk_keys, namespace_for
from agentstate.ops.verify import verify

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from tests.test_adapter_vllm import req, run_engine, toks  # noqa: E402
from vllm_engine import make_hybrid_model, make_sliding_model  # noqa: E402

C = 288  # vLLM's attention block on this model, so the chunk
# Each prompt ends one token past a boundary: the first token generated after a load comes from the
# loaded state itself (a GDN layer's conv state moves the next few tokens' logits by whole units; ten
# tokens on, a wrong state's effect has faded below what greedy decoding shows).
H1 = toks(2 * C + 1, 11)
H2 = H1[: 2 * C] + toks(C + 1, 12)  # H1's first two chunks, then one of its own and a token
SESSION = {"agentstate": {"session_id": "hybrid-1", "state": {"turn": 1}}}
SESSION2 = {"agentstate": {"session_id": "hybrid-1", "state": {"turn": 2}}}
EXTRA = toks(1, 13)  # the next turn computes two tokens past the session: its state decides them


def job(model: str, data: Path | None, rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    # chunked prefill: vLLM's Mamba "align" mode needs it; block_size asked for (vLLM widens it to 288):
    # its prefix hashes are then per block, so prefill steps end on block (chunk) boundaries
    return {"model": model, "dtype": "bfloat16", "block_size": 16, "chunked_prefill": True,
            "max_num_batched_tokens": 2048, "max_model_len": 2048, "num_blocks": 64, "round_metrics": True,
            "connector": None if data is None else {"path": str(data)}, "rounds": rounds}  # fmt: skip


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-hybrid")


@pytest.fixture(scope="module")
def model(tmp: Path) -> str:
    return make_hybrid_model(str(tmp / "model"))


@pytest.fixture(scope="module")
def data(tmp: Path) -> Path:
    return tmp / "data"


@pytest.fixture(scope="module")
def conn(tmp: Path, model: str, data: Path) -> dict[str, Any]:
    turn2 = {"continue": [3, 0], "extra": EXTRA, "max_tokens": 8, "params": SESSION2}
    # the reference: the same prompts computed cold in this engine, each under a cache_salt of its own (a
    # tenant with nothing stored, and vLLM's own cache keyed apart)
    cold = [[req(H1, salt="cold-1")], [req(H2, salt="cold-2")], [{**turn2, "params": None, "salt": "cold-3"}]]
    return run_engine(tmp, "conn", job(model, data, [[req(H1)], [req(H1)], [req(H2)], [req(H1, params=SESSION)],
                                                     [turn2], *cold]))  # fmt: skip


@pytest.fixture(scope="module")
def base(conn: dict[str, Any]) -> dict[str, Any]:
    """The reference tokens: each prompt computed with nothing stored and nothing cached."""
    (h1,), (h2,), (turn2,) = conn["rounds"][5:8]
    assert h1["cached"] == h2["cached"] == turn2["cached"] == 0
    return {"H1": h1, "H2": h2, "turn2": turn2}


def _metric(out: dict[str, Any], rnd: int, name: str) -> float:
    """A connector metric's growth in round `rnd`."""
    now = out["round_metrics"][rnd].get(f"vllm:agentstate_{name}", 0)
    return now - (out["round_metrics"][rnd - 1].get(f"vllm:agentstate_{name}", 0) if rnd else 0)


def test_hybrid_prefix_loads_its_chunks_and_state(base: dict[str, Any], conn: dict[str, Any]) -> None:
    """H1 stores two chunks and the GDN state at their end; the same prompt then loads them (vLLM's own
    cache emptied) and continues token-identical to the same prompt computed cold; H2 loads H1's
    boundary and goes on from there."""
    (h1,), (h1b,), (h2,), (h1s,) = conn["rounds"][:4]
    assert h1["cached"] == 0 and h1["tokens"] == base["H1"]["tokens"]
    assert h1b["cached"] == 2 * C and h1b["tokens"] == base["H1"]["tokens"]
    assert _metric(conn, 1, "states_loaded") == 1
    assert h2["cached"] == 2 * C and h2["tokens"] == base["H2"]["tokens"]
    # (its step after the load ends at 864: the state there is stored, which `library` finds; writes land
    # off the step, so a round's metrics may not count them yet)
    assert h1s["cached"] == 2 * C and h1s["tokens"] == base["H1"]["tokens"]
    assert conn["metrics"].get("vllm:agentstate_errors", 0) == 0


def test_hybrid_session_resumes_whole_at_its_exact_end(base: dict[str, Any], conn: dict[str, Any]) -> None:
    """A request naming a session is snapshotted when it finishes: its tokens' KV and the GDN state after
    its last one (vLLM's align mode keeps the running state in the block holding that token). The next
    turn, whose prompt extends it, loads all of it (584 tokens: not a chunk boundary) and continues
    token-identical to the same prompt computed cold."""
    turn2 = conn["rounds"][4][0]
    n = len(H1) + 8 - 1  # the first turn's prompt and output, the last sampled token excepted
    assert conn["metrics"].get("vllm:agentstate_sessions_saved", 0) >= 1  # each turn's; written off the step
    assert turn2["cached"] == n and turn2["tokens"] == base["turn2"]["tokens"]
    assert _metric(conn, 4, "states_loaded") == 1


def _keys(spec: ModelSpec, tokens: list[int]) -> list[str]:
    return list(chunk_keys(tokens, namespace=namespace_for("default"), fingerprint=spec.fingerprint, chunk_tokens=C,
                           chain=spec.model_fingerprint))  # fmt: skip


@pytest.fixture(scope="module")
def library(conn: dict[str, Any], data: Path) -> bool:
    """What the engine wrote, read by the library and the CLI: a hybrid spec (the GDN layers' state
    tensors as vLLM binds them), H2's prefix stored to its third boundary, every value intact. Then the
    state at 864 is damaged on disk, for the next engine."""
    spec = ModelSpec.model_validate_json((data / "spec.json").read_text())
    assert spec.state is not None and spec.num_layers == 2  # the attention layers; the GDN layers' states
    assert [t.name for t in spec.state.tensors][:2] == ["model.layers.0.linear_attn.s0.SD", "model.layers.0.linear_attn.s1"]
    cli = subprocess.run([sys.executable, "-m", "agentstate", "verify", "--path", str(data), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert cli.returncode == 0, (cli.stdout[-2000:], cli.stderr[-2000:])
    keys = _keys(spec, H2[: 3 * C])
    ls = subprocess.run([sys.executable, "-m", "agentstate", "ls", "--path", str(data), "--json"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert ls.returncode == 0 and "hybrid-1" in ls.stdout, ls.stderr[-2000:]

    async def check() -> None:
        recorded = recorded_config(data)  # the engine's chunk size (its block: 288)
        assert recorded is not None and recorded.store["chunk_tokens"] == C
        async with StateStore.open(StoreConfig(**recorded.store), spec) as store:
            assert (await verify(store)).clean
            assert await store.lookup_keys(keys) == 3
            assert await store.lookup_keys(_keys(spec, H1[: 2 * C] + toks(C, 99))) == 2  # H1's boundary, not past it
            state = await store.prefix_state(H2, 3 * C)
            assert state is not None and set(state) == {t.name for t in spec.state.tensors}
            session = await store.resume("hybrid-1")  # the second turn's snapshot: KV and state, whole
            assert session.complete and session.model_state is not None and session.state == {"turn": 2}
            value = await store.chunks.raw_value("lmdb", boundary_key(keys[2]))
            assert value is not None
            bad = bytearray(value)
            bad[-5] ^= 0x5A
            await store.chunks.backend("lmdb").put([boundary_key(keys[2])], [bytes(bad)])  # as a disk would damage it

    asyncio.run(check())
    return True


def test_library_reads_what_the_engine_stored(library: bool) -> None:
    assert library


@pytest.fixture(scope="module")
def again(tmp: Path, model: str, data: Path, library: bool) -> dict[str, Any]:
    return run_engine(tmp, "again", job(model, data, [[req(H2)], [req(H2)], [req(H1)]]))


def test_damaged_state_recomputes_the_request_and_is_stored_again(base: dict[str, Any], again: dict[str, Any]) -> None:
    """A new engine on the same directory: H2's hit (to 864) meets the damaged state, the load fails as a
    whole request (vLLM recomputes it: a state's KV without the state would continue wrongly), the
    recompute stores the state again and the next H2 loads all 864 tokens; H1 still hits at 576."""
    (h2,), (h2b,), (h1,) = again["rounds"]
    assert h2["tokens"] == base["H2"]["tokens"]
    assert _metric(again, 0, "states_loaded") == 0
    assert h2b["cached"] == 3 * C and h2b["tokens"] == base["H2"]["tokens"]
    assert _metric(again, 1, "states_loaded") == 1
    assert h1["cached"] == 2 * C and h1["tokens"] == base["H1"]["tokens"]


# -- sliding windows: Gemma 3 ------------------------------------------------------------------------

G1 = toks(513, 21)  # two chunks and a token
G2 = G1[:512] + toks(300, 22)


@pytest.fixture(scope="module")
def sliding(tmp: Path) -> dict[str, Any]:
    """A Gemma 3 (sliding layers, a 64-token window, between full-attention ones) with the connector,
    vLLM's hybrid allocator on (the sliding layers' blocks before the window go back to the pool while a
    request runs); the reference: each prompt computed cold under a cache_salt of its own."""
    model = make_sliding_model(str(tmp / "gemma"))
    rounds = [[req(G1)], [req(G1)], [req(G2)], [req(G2)], [req(G1, salt="cold-1")], [req(G2, salt="cold-2")]]
    conn = run_engine(tmp, "gemma-conn", {"model": model, "max_model_len": 2048, "num_blocks": 256, "rounds": rounds,
                                          "connector": {"path": str(tmp / "gemma-data")}})  # fmt: skip
    got = [r[0] for r in conn["rounds"]]
    return {"base": [got[4], got[4], got[5], got[5]], "conn": got[:4], "out": conn}


def test_sliding_window_model_loads_every_attention_layer(sliding: dict[str, Any]) -> None:
    """Chunks hold the full and the sliding layers' KV; a load writes the sliding layers into the blocks
    vLLM gave the window only (null blocks before it skipped): G1 again, then G2 on G1's chunks, then G2
    on its own third chunk, each token-identical to the same prompt computed cold."""
    base, conn = sliding["base"], sliding["conn"]
    assert [r["cached"] for r in conn] == [0, 512, 512, 768] and base[0]["cached"] == base[2]["cached"] == 0
    assert [r["tokens"] for r in conn] == [r["tokens"] for r in base]
    assert sliding["out"]["metrics"].get("vllm:agentstate_errors", 0) == 0


# -- the groups, from vLLM's own classes, no engine -------------------------------------------------


def _config(*specs: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{i}.x"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_groups_of_vllm_kv_cache_configs() -> None:
    """A dense model's one full-attention group keeps the dense path (None); full, sliding and Mamba
    (align) groups are read with each Mamba layer's state tensors; any other kind, a Mamba group not in
    align mode, a block size other than the engine's are refused (typed) before anything opens."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    from agentstate.adapters.vllm.groups import groups_of

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    slide = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64)
    mamba = MambaSpec(block_size=16, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.bfloat16, torch.float32),
                      mamba_cache_mode="align")  # fmt: skip
    assert groups_of(_config(full), 16) is None
    g = groups_of(_config(mamba, full, slide), 16)
    assert g is not None and g.kinds == ("mamba", "full", "sliding") and g.window == 64 and g.state_group == 0
    assert g.attention == {"model.layers.1.x": 1, "model.layers.2.x": 2}
    assert g.state is not None and [(t.shape, t.dtype) for t in g.state.tensors] == [((3, 8), "bfloat16"),
                                                                                   ((2, 4, 4), "float32")]  # fmt: skip
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    for bad, why in [((full, mla), "MLAAttentionSpec"), ((full, slide), "block size"),
                     ((full, MambaSpec(block_size=16, shapes=((3, 8),), dtypes=(torch.bfloat16,))), "align"),
                     ((mamba,), "without attention")]:  # fmt: skip
        with pytest.raises(InvalidArgumentError, match=why):
            groups_of(_config(*bad), 16 if why != "block size" else 32)
