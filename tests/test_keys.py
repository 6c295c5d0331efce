from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from agentstate.errors import InvalidArgumentError, InvalidSessionIdError
from agentstate.keys import chunk_keys, namespace_for, tail_key, token_array, validate_id
from tests.conftest import SPEC4, random_tokens

FP = SPEC4.fingerprint


def keys(tokens: list[int], ns: str = "tenant:a", fp: str = FP, c: int = 64) -> list[str]:
    return list(chunk_keys(tokens, namespace=ns, fingerprint=fp, chunk_tokens=c))


def test_equal_prefixes_equal_keys_and_chain_diverges_after_a_change() -> None:
    toks = random_tokens(300)
    a = keys(toks)
    assert len(a) == 4  # 300 // 64, the partial rest is a tail
    other = toks[:100] + [toks[100] + 1] + toks[101:]
    b = keys(other)
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:]))


def test_keys_are_scoped_by_namespace_spec_and_chunk_size() -> None:
    toks = random_tokens(128)
    base = keys(toks)
    assert keys(toks, ns="tenant:b") != base
    assert keys(toks, fp="f" * 32) != base
    assert keys(toks, c=32)[1] != base[0]
    assert all(k.startswith(f"c/{FP}/") for k in base)


def test_keys_are_identical_in_another_process_with_another_hash_seed() -> None:
    toks = random_tokens(200)
    code = (
        "from agentstate.keys import chunk_keys;"
        f"print('\\n'.join(chunk_keys({toks!r}, namespace='tenant:a', fingerprint={FP!r}, chunk_tokens=64)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "12345"}
    ).stdout.split()
    assert out == keys(toks)


@pytest.mark.parametrize("bad", ["", "../etc", "a/b", "-x", ".hidden", "a b", "x" * 129, None, 5, "é"])
def test_bad_ids_rejected(bad: object) -> None:
    with pytest.raises(InvalidSessionIdError):
        validate_id(bad)


@pytest.mark.parametrize("good", ["s1", "agent-42", "user@team:thread.7", "_x", "x" * 128])
def test_good_ids_accepted(good: str) -> None:
    assert validate_id(good) == good


def test_bad_tokens_and_namespaces() -> None:
    with pytest.raises(InvalidArgumentError):
        token_array([1, -2])
    with pytest.raises(InvalidArgumentError):
        token_array(["a"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError):
        token_array([2**64])
    with pytest.raises(InvalidSessionIdError):
        namespace_for("../t")
    assert namespace_for("t", shared=True) == "global"
    assert tail_key(FP, "t", "s", 3, "w1") == f"t/{FP}/t/s/3.w1"
    assert tail_key(FP, "t", "s", 3) != tail_key(FP, "t", "s", 3)  # one per write attempt


def test_sglang_page_keys_follow_sglangs_definition_and_tenants_stay_apart() -> None:
    """SGLang's page chain written out here from its definition: SHA-256 over the previous digest (the
    namespace seed for the first page when the request has a salt) and each token as 4 bytes LE."""
    import hashlib
    import struct

    from agentstate.adapters.sglang_keys import sglang_page_keys, sglang_seed

    tokens = list(range(1000, 1040))
    seed = hashlib.sha256(b"sglang-cache-namespace-v1" + b"\x00" + b"\x01" + (3).to_bytes(8, "little") + b"abc")
    for salt, prev in ((None, b""), ("abc", seed.digest())):
        want = []
        for i in range(0, 32, 16):
            prev = hashlib.sha256(prev + struct.pack("<16I", *tokens[i : i + 16])).digest()
            want.append(f"p/fp/16/pp0-1.cp0-1/{prev.hex()}")
        assert sglang_page_keys(tokens, fingerprint="fp", page_size=16, shard="pp0-1.cp0-1", salt=salt) == want
    assert sglang_seed(None, None) is None and sglang_seed(None, "abc") == seed.digest()
    with pytest.raises(InvalidArgumentError):
        sglang_page_keys([2**32], fingerprint="fp", page_size=1, shard="s")


async def test_the_sglang_scheme_keys_prefixes_by_page_and_salts_other_tenants(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from agentstate import StateStore, StoreConfig
    from agentstate.adapters.sglang_keys import sglang_page_keys
    from tests.conftest import SPEC4, random_kv, random_tokens

    cfg = StoreConfig(path=tmp_path / "s", chunk_tokens=16, key_scheme="sglang:pp0-1.cp0-1.t")
    tokens = random_tokens(50)
    async with StateStore.open(cfg, SPEC4) as store:
        mine = sglang_page_keys(tokens, fingerprint=SPEC4.fingerprint, page_size=16, shard="pp0-1.cp0-1.t")
        assert store.prefix_keys(tokens) == mine  # the store's own tenant: SGLang's requests without a salt
        other = store.for_tenant("b")
        assert other.prefix_keys(tokens) == sglang_page_keys(
            tokens, fingerprint=SPEC4.fingerprint, page_size=16, shard="pp0-1.cp0-1.t", salt="b")
        assert await store.put_prefix(tokens, random_kv(SPEC4, 50)) == 48
        assert (await store.match(tokens)).tokens == 48 and (await other.match(tokens)).tokens == 0
        out = SPEC4.empty_kv(48)
        assert await store.load(tokens, out) == 48
        assert out.view(torch.uint8).equal(random_kv(SPEC4, 50)[:, :, :48].contiguous().view(torch.uint8))
    from agentstate.settings import store_config

    for bad in ("sglang:../evil", "nosuch", "sglang:a/b", "SGLANG"):  # typed, before anything opens
        with pytest.raises(InvalidArgumentError):
            store_config(None, path=tmp_path / "x", key_scheme=bad)
            async with StateStore.open(store_config(None, path=tmp_path / "x", key_scheme=bad), SPEC4):
                pass
    assert not (tmp_path / "x").exists()


async def test_under_the_sglang_scheme_a_session_is_stored_as_sglang_pages_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A session's chunks are the very pages its prefix has (stored once), resumed bit-exact, gone with it."""
    from agentstate import StateStore, StoreConfig
    from agentstate.adapters.sglang_keys import sglang_page_keys
    from agentstate.ops.verify import verify
    from tests.conftest import SPEC4, random_kv, random_tokens

    cfg = StoreConfig(path=tmp_path / "s", chunk_tokens=16, key_scheme="sglang")
    tokens, kv = random_tokens(70), random_kv(SPEC4, 70)
    async with StateStore.open(cfg, SPEC4) as store:
        manifest = await store.snapshot("agent", tokens, kv)
        pages = sglang_page_keys(tokens, fingerprint=SPEC4.fingerprint, page_size=16)
        assert manifest.chunk_keys == pages and len(pages) == 4
        assert (await store.match(tokens)).tokens == 64  # the session's pages are the prefix's
        assert await store.put_prefix(tokens, kv) == 0  # nothing new: stored once
        got = await store.resume("agent")
        assert got.restored_tokens == 70 and got.kv.view(torch.uint8).equal(kv.view(torch.uint8))
        report = await verify(store)
        assert report.clean and not report.missing and not report.orphans
        await store.delete("agent")
        assert (await store.match(tokens)).tokens == 64  # the prefix record still names them
        await store.snapshot("alone", tokens[:40] + [7] * 30, random_kv(SPEC4, 70, seed=3))
        own = sglang_page_keys(tokens[:40] + [7] * 30, fingerprint=SPEC4.fingerprint, page_size=16)[2:]
        assert await store.chunks.present(own) == [True, True]
        await store.delete("alone")
        assert await store.chunks.present(own) == [False, False]  # nothing else named them: gone with it
