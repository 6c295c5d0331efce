"""Hybrid models (agentstate.model_state, adapters/transformers_state.py): sessions and shared prefixes of
tiny random transformers models whose layers mix full attention with GatedDeltaNet (Qwen3-Next), Mamba2
(Granite 4 hybrid), short convolutions (LFM2) and sliding windows (Gemma 3), on real LMDB.

A resumed session continues exactly as the run that never stopped (logits bit for bit); a prefix is a
hit up to the last boundary whose state is stored; bad input is a typed error and changes nothing.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from agentstate import StateStore
from agentstate.adapters import transformers as tfa
from agentstate.adapters import transformers_state
from agentstate.errors import KVShapeError, SessionNotFoundError
from agentstate.keys import boundary_key
from agentstate.ops.admin import inspect_session, list_sessions
from agentstate.ops.verify import verify

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2)  # fmt: skip
ARCHS: dict[str, dict[str, Any]] = {
    "qwen3_next": dict(layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, head_dim=16, num_experts=0, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64, mlp_only_layers=[0, 1, 2, 3]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
                             mamba_d_state=16, mamba_n_groups=1, mamba_expand=1, num_local_experts=0,
                             shared_intermediate_size=128),
    "lfm2": dict(layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "gemma3_text": dict(layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                        sliding_window=8, head_dim=16),
}  # fmt: skip
C = 16


def build(arch: str) -> Any:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **TINY, **ARCHS[arch])).eval()
    with torch.no_grad():  # sharper logits: greedy tokens follow the context, not noise
        for p in model.parameters():
            p.mul_(3.0)
    return model


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def run(model: Any, ids: list[int], cache: Any = None) -> tuple[torch.Tensor, Any]:
    with torch.no_grad():
        out = model(torch.tensor([ids]), cache=cache, use_cache=True)
    return out.logits[0, -1], out.cache if getattr(out, "cache", None) is not None else out.past_key_values


def decode(model: Any, cache: Any, token: int, steps: int = 8) -> list[torch.Tensor]:
    logits = []
    for _ in range(steps):
        last, cache = run(model, [token], cache)
        logits.append(last)
        token = int(last.argmax())
    return logits


def reference(arch: str, seed: int) -> tuple[Any, Any, list[int], Any, int, list[torch.Tensor]]:
    """A tiny model of `arch`, its spec, 45 prompt tokens, the cache after them, the next token and the
    logits of 8 decode steps of the run that never stopped (what a resumed session must equal)."""
    model = build(arch)
    spec = tfa.spec_for(model, model_id=f"test/{arch}")
    ids = tokens(45, seed=seed)
    last, cache = run(model, ids)
    nxt = int(last.argmax())
    return model, spec, ids, cache, nxt, decode(model, copy.deepcopy(cache), nxt)


async def continues(store: StateStore, model: Any, ids: list[int], want: list[torch.Tensor]) -> None:
    """Session "s" resumes whole, and its decode is bit for bit `want` (the run that never stopped)."""
    got = await tfa.resume(store, "s", model)
    assert got.restored_tokens == len(ids) and got.tokens == ids
    logits = decode(model, got.cache, got.state["next"])
    assert all(torch.equal(a, b) for a, b in zip(logits, want))
    assert (await verify(store)).clean


def open_store(path: Path, spec: Any, **kw: Any) -> Any:
    return StateStore.open(path, spec, chunk_tokens=C, lmdb_map_size=64 << 20, **kw)


@pytest.mark.parametrize("arch", sorted(ARCHS))
async def test_a_resumed_session_continues_as_the_run_that_never_stopped(tmp_path: Path, arch: str) -> None:
    model, spec, ids, cache, nxt, want = reference(arch, seed=1)
    assert spec.state is not None
    async with open_store(tmp_path / "d", spec) as store:
        await tfa.snapshot(store, "s", ids, cache, {"next": nxt})
    async with open_store(tmp_path / "d", spec) as store:  # from disk, after a restart
        await continues(store, model, ids, want)


async def test_ls_inspect_and_verify_know_a_hybrid_session(tmp_path: Path) -> None:
    model = build("qwen3_next")
    spec = tfa.spec_for(model, model_id="test/qwen3_next")
    ids = tokens(40, seed=2)
    _, cache = run(model, ids)
    async with open_store(tmp_path / "d", spec) as store:
        m = await tfa.snapshot(store, "s", ids, cache)
        assert m.state_key is not None and m.state_key.endswith(".state")
        detail = await inspect_session(store, "s")
        assert [c.kind for c in detail.chunks] == ["chunk", "chunk", "tail", "state"] and detail.state_key == m.state_key
        state_bytes = detail.chunks[-1].bytes
        assert state_bytes == 64 + spec.state.nbytes_at(40)  # type: ignore[union-attr]
        assert (await list_sessions(store))[0].bytes == sum(c.bytes for c in detail.chunks)
        fork = await store.fork("s", "s2")
        assert fork.state_key == m.state_key  # named, not copied: kept while either names it
        await store.delete("s")
        assert (await tfa.resume(store, "s2", model)).restored_tokens == 40
        report = await verify(store)
        assert report.clean and report.orphans == []


async def test_a_damaged_state_is_never_served_and_verify_names_it(tmp_path: Path) -> None:
    model = build("granitemoehybrid")
    spec = tfa.spec_for(model, model_id="test/granite")
    ids = tokens(40, seed=3)
    _, cache = run(model, ids)
    async with open_store(tmp_path / "d", spec) as store:
        m = await tfa.snapshot(store, "s", ids, cache)
        backend = store.chunks.backend("lmdb")
        value = bytearray((await store.chunks.raw_value("lmdb", m.state_key)))  # type: ignore[arg-type]
        value[-3] ^= 0x40
        await backend.put([m.state_key], [bytes(value)])  # type: ignore[list-item]
    async with open_store(tmp_path / "d", spec) as store:
        report = await verify(store)
        assert not report.clean and [b.key for b in report.corrupt] == [m.state_key]
        assert report.affected[0].restorable_tokens == 0
        got = await tfa.resume(store, "s", model)  # the KV alone would continue wrong: nothing restored
        assert got.restored_tokens == 0 and got.cache.get_seq_length() == 0
        result = await store.resume("s")
        assert result.restored_tokens == 0 and result.model_state is None


async def test_bad_model_state_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    model = build("lfm2")
    spec = tfa.spec_for(model, model_id="test/lfm2")
    ids = tokens(40, seed=4)
    _, cache = run(model, ids)
    kv, state, _ = transformers_state.split(cache, spec)
    async with open_store(tmp_path / "d", spec) as store:
        await store.snapshot("kept", ids, kv, model_state=state)
        with pytest.raises(KVShapeError, match="model_state"):
            await store.snapshot("s", ids, kv)  # a hybrid spec needs its state
        wrong = {**state, next(iter(state)): torch.zeros(3)}
        with pytest.raises(KVShapeError):
            await store.snapshot("s", ids, kv, model_state=wrong)
        with pytest.raises(KVShapeError):
            await store.snapshot("s", ids, kv, model_state={**state, "9.conv0": torch.zeros(1)})
        with pytest.raises(KVShapeError):
            await store.snapshot("s", ids, kv, model_state={k: v.double() for k, v in state.items()})
        with pytest.raises(KVShapeError):  # a boundary's state of the wrong shape: nothing written
            await store.put_chunks(ids[:C], {0: kv[:, :, :C]}, model_state=wrong)
        with pytest.raises(KVShapeError):  # a boundary is whole chunks
            await store.put_chunks(ids[: C + 3], {0: kv[:, :, :C]}, model_state=state)
        with pytest.raises(KVShapeError):
            await store.put_prefix(ids[: C + 3], kv[:, :, : C + 3], model_state=state)
        with pytest.raises(SessionNotFoundError):
            await store.resume("s")
        assert [r.session_id for r in await list_sessions(store)] == ["kept"]
        assert (await verify(store)).clean
    dense = spec.model_copy(update={"state": None, "model_id": "test/dense"})
    async with open_store(tmp_path / "dense", dense) as store:
        with pytest.raises(KVShapeError, match="no state layout"):
            await store.snapshot("s", ids, kv, model_state=state)


async def test_a_shared_prefix_hits_up_to_its_last_stored_boundary(tmp_path: Path) -> None:
    """Two agents share a 48-token system prompt: the second's prefill starts from the first's boundary
    at 48 tokens (state and KV there), and ends where a prefill with nothing stored ends, bit for bit."""
    model = build("qwen3_next")
    spec = tfa.spec_for(model, model_id="test/qwen3_next")
    system = tokens(48, seed=5)
    first, second = system + tokens(21, seed=6), system + tokens(30, seed=7)
    async with open_store(tmp_path / "ref", spec) as ref:  # nothing stored before: the reference
        want = await tfa.prefill(ref, second, model, every=1)
    async with open_store(tmp_path / "d", spec) as store:
        await tfa.prefill(store, first, model, every=1)  # boundaries every chunk: 16, 32, 48, 64
        hit = await tfa.load_prefix(store, second, model)
        assert hit.tokens == 48
        got = await tfa.prefill(store, second, model, every=1)
        last_want, _ = run(model, [second[-1]], want)
        last_got, _ = run(model, [second[-1]], got)
        assert torch.equal(last_got, last_want)
        assert (await tfa.load_prefix(store, second, model)).tokens == 64  # its own boundaries now
        # boundaries lost: the hit stops at the last one left, never at KV without its state
        await store.chunks.delete([boundary_key(k) for k in store.prefix_keys(second)[2:4]])
        assert (await tfa.load_prefix(store, second, model)).tokens == 32
        assert (await store.match(second)).tokens == 32


def test_hybrid_bytes_per_token_and_boundary_are_what_the_layout_says() -> None:
    model = build("qwen3_next")
    spec = tfa.spec_for(model, model_id="test/qwen3_next")
    assert spec.num_layers == 1 and spec.state is not None  # one full-attention layer of four
    assert {t.name for t in spec.state.tensors} == {f"{i}.{p}0" for i in range(3) for p in ("conv", "recurrent")}
    assert spec.state.nbytes_at(10) == spec.state.nbytes_at(10_000)  # an SSM's state does not grow
    windows = tfa.spec_for(build("gemma3_text"), model_id="test/gemma").state
    assert windows is not None and windows.nbytes_at(3) < windows.nbytes_at(7) == windows.nbytes_at(700)


async def test_a_value_of_another_spec_read_as_kv_is_skipped_never_dropped(tmp_path: Path) -> None:
    """A hybrid state asked for as KV (a caller's mistake, or keys of two specs side by side) is not
    this reader's: the read misses, and the value stays (only a damaged value is dropped)."""
    from agentstate.target import TensorTarget

    model = build("qwen3_next")
    spec = tfa.spec_for(model, model_id="test/qwen3_next")
    ids = tokens(40, seed=8)
    _, cache = run(model, ids)
    async with open_store(tmp_path / "d", spec) as store:
        m = await tfa.snapshot(store, "s", ids, cache)
        key = m.state_key
        assert key is not None
        kv = spec.empty_kv(8)
        with store.chunks.pinned([key]):
            assert await store.chunks.read([key], [(0, 8)], TensorTarget(kv, spec)) == [False]
        assert await store.chunks.raw_value("lmdb", key) is not None
        assert (await tfa.resume(store, "s", model)).restored_tokens == 40
        assert store.chunks.counters().get("corrupt", 0) == 0


def test_a_state_layout_no_model_has_is_refused_when_read(tmp_path: Path) -> None:
    """A spec file (a directory's spec.json, a --spec file) describing a state larger than any model's
    is a typed error before anything allocates it; so are malformed layouts."""
    from agentstate.datadir import read_spec_file
    from agentstate.errors import InvalidArgumentError

    base = tfa.spec_for(build("lfm2"), model_id="test/lfm2").model_dump()
    for state in ({"tensors": [{"name": "0.conv0", "shape": [1 << 24, 1 << 24], "dtype": "float32"}]},
                  {"tensors": [{"name": "a", "shape": [4], "dtype": "int64"}]},
                  {"tensors": [{"name": "a", "shape": [0], "dtype": "float32"}]},
                  {"tensors": [{"name": "a/../b", "shape": [4], "dtype": "float32"}]},
                  {"tensors": [{"name": "a", "shape": [4], "dtype": "float32", "window_dim": 3}]},
                  {"tensors": [{"name": "a", "shape": [4], "dtype": "float32"}] * 2},
                  {"tensors": []}):  # fmt: skip
        file = tmp_path / "spec.json"
        file.write_text(__import__("json").dumps({**base, "state": state}))
        with pytest.raises(InvalidArgumentError):
            read_spec_file(file)


async def test_every_state_tensor_comes_back_bit_for_bit_whatever_its_size_and_dtype(tmp_path: Path) -> None:
    """A layout of tensors of odd byte counts and mixed dtypes (each after the other in one value):
    snapshot, restart, resume give back every byte, NaNs and infinities included."""
    from agentstate import ModelSpec
    from agentstate.spec import StateLayout, StateTensor

    layout = StateLayout(tensors=(
        StateTensor(name="0.conv0", shape=(1, 3, 3), dtype="bfloat16"),
        StateTensor(name="0.recurrent0", shape=(1, 5, 7), dtype="float32"),
        StateTensor(name="1.keys", shape=(1, 1, 9, 3), dtype="float16", window_dim=2),
        StateTensor(name="2.bytes", shape=(7,), dtype="uint8"),
    ))  # fmt: skip
    spec = ModelSpec(model_id="test/odd", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", state=layout)
    g = torch.Generator().manual_seed(9)
    for n in (5, 40):  # a window not yet full, then full
        state = {t.name: torch.randint(0, 256, (t.nbytes_at(n),), generator=g, dtype=torch.uint8).view(
            {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16, "uint8": torch.uint8}[t.dtype]
        ).view(t.shape_at(n)) for t in layout.tensors}  # fmt: skip
        kv = torch.randn(spec.kv_shape(n))
        async with open_store(tmp_path / f"d{n}", spec) as store:
            await store.snapshot("s", list(range(3, 3 + n)), kv, model_state=state)
        async with open_store(tmp_path / f"d{n}", spec) as store:
            got = await store.resume("s")
        assert got.complete and got.model_state is not None and torch.equal(got.kv, kv)
        for name, want in state.items():
            assert got.model_state[name].view(torch.uint8).equal(want.view(torch.uint8)), name


def _rewrite(src: Path, dst: Path, edit: Any) -> None:
    """A copy of archive `src` with `edit(files, index)` applied (members by name, index as JSON)."""
    import io
    import json
    import tarfile

    from agentstate.ops.archive import INDEX

    with tarfile.open(src) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    index = json.loads(files[INDEX])
    edit(files, index)
    files[INDEX] = json.dumps(index).encode()
    with tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, raw in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))


async def test_a_hybrid_session_exports_and_imports_with_its_state(tmp_path: Path) -> None:
    """An archive carries a hybrid session's state beside its chunks (a member of its own, a frame of
    the state spec bound to its name): imported into another directory and tenant, the session
    resumes and continues bit for bit as the run that never stopped. An archive whose state member is
    damaged, swapped for a chunk, or left out of a session is refused before anything is written."""
    import xxhash

    from agentstate.errors import CorruptDataError
    from agentstate.ops.archive import export_sessions, import_sessions

    model, spec, ids, cache, nxt, want = reference("qwen3_next", seed=11)
    async with open_store(tmp_path / "src", spec) as store:
        await tfa.snapshot(store, "s", ids, cache, {"next": nxt})
        report = await export_sessions(store, tmp_path / "a.tar")
    assert report.sessions == 1 and report.chunks == 4  # two chunks, a tail, the state

    def damaged(files: dict[str, bytes], index: dict[str, Any]) -> None:
        name = index["sessions"][0]["model_state"]
        raw = bytearray(files[name])
        raw[-9] ^= 0x20
        files[name] = bytes(raw)
        index["members"][name]["xxh3"] = xxhash.xxh3_64_hexdigest(bytes(raw))  # the index agrees: the frame must not

    def swapped(files: dict[str, bytes], index: dict[str, Any]) -> None:
        session = index["sessions"][0]
        session["model_state"] = session["chunks"][0]

    def dropped(files: dict[str, bytes], index: dict[str, Any]) -> None:
        index["sessions"][0]["model_state"] = None

    for name, edit in [("damaged", damaged), ("swapped", swapped), ("dropped", dropped)]:
        _rewrite(tmp_path / "a.tar", tmp_path / f"{name}.tar", edit)
    async with open_store(tmp_path / "dst", spec) as store:
        for name in ("damaged", "swapped", "dropped"):
            with pytest.raises(CorruptDataError):
                await import_sessions(store, tmp_path / f"{name}.tar")
            assert [m async for m in store.sessions()] == []  # nothing was written
        await import_sessions(store, tmp_path / "a.tar", tenant="other")
    async with open_store(tmp_path / "dst", spec, tenant="other") as store:
        await continues(store, model, ids, want)


async def test_a_hybrid_session_over_the_http_api(tmp_path: Path) -> None:
    """The session API carries a hybrid model's state after the KV in one frame (the header's
    `model_state_bytes`, one checksum over both): snapshotted by the SDK, resumed through it, built
    into a cache, the continuation is bit for bit the run that never stopped. Frames whose state is
    missing, of the wrong size, or given to a dense spec are typed errors and store nothing."""
    import httpx

    from agentstate.client import AsyncClient
    from agentstate.errors import KVShapeError
    from tests.test_service import ALICE, frame, serving

    model, spec, ids, cache, nxt, want = reference("lfm2", seed=12)
    kv, state, _ = transformers_state.split(cache, spec)
    async with open_store(tmp_path / "d", spec) as store, serving(store) as url:
        async with AsyncClient(url, ALICE, spec=spec) as client:
            with pytest.raises(KVShapeError):  # checked here before anything is sent
                await client.snapshot("s", ids, kv)
            info = await client.snapshot("s", ids, kv, {"next": nxt}, model_state=state)
            assert info.num_tokens == 45
            got = await client.resume("s")
            assert got.restored_tokens == 45 and got.model_state is not None
            assert all(torch.equal(got.model_state[k], v) for k, v in state.items())
            built = transformers_state.build(model.config, spec, got.kv, got.model_state, model.device)
            assert all(torch.equal(a, b) for a, b in zip(decode(model, built, nxt), want))
        head = {"fingerprint": spec.fingerprint, "dtype": spec.dtype, "shape": list(kv.shape), "tokens": ids}
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {ALICE}"}) as http:
            for bad in ({}, {"model_state_bytes": 7}):  # no state; a state of the wrong size
                r = await http.post("/v1/sessions/bad/snapshot", content=frame({**head, **bad}, kv))
                assert r.status_code in (400, 422) and r.json()["error"] in ("kv_shape", "malformed"), r.text
        assert [m.session_id async for m in store.for_tenant("alice").sessions()] == ["s"]  # nothing else stored
