"""SGLang adapter: loaded through SGLang's own StorageBackendFactory ("dynamic"), as SGLang attaches it.

The HiCacheStorage classes, the factory and the storage config are SGLang's real ones. Host pools:
`StandInHostPool` below is a stand-in (marked) for the in-process tests, because the module of
SGLang's real `MHATokenToKVPoolHost` imports SGLang's whole model-config registry, which needs
torchvision (PyPI has only a CUDA build, which cannot load against the CPU torch here) and
packages that requirements-sglang.txt does not list. `test_real_host_pool` builds the real pool
classes on CPU in a subprocess (`pin_memory=False`, an empty torchvision placeholder) and is
skipped, saying which package is missing, where they are not installed. Comparisons are bitwise.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch

from tests.requires import require_module  # noqa: I001 (guards the imports below)
from tests.sglang_child import TORCHVISION_PLACEHOLDER, run_child
require_module("sglang.srt.mem_cache.storage.backend_factory", "install requirements-sglang.txt as .ci/run does")
from agentstate.adapters.sglang import AgentStateStorage
from agentstate.errors import SpecMismatchError
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

EXTRA = {"backend_name": "agentstate", "module_path": "agentstate.adapters.sglang", "class_name": "AgentStateStorage",
         "interface_v1": 1, "lmdb_map_size": 64 << 20, "host_capacity_bytes": 64 << 20}  # fmt: skip
PS = 4  # tokens per page


class StandInHostPool:
    """STAND-IN for SGLang's MHATokenToKVPoolHost (see the module docstring): the same `kv_buffer`
    layouts (`layer_first` [2, L, slots, H, D], `page_first` [2, slots, L, H, D]) and page methods."""

    def __init__(self, layout: str = "page_first", dtype: torch.dtype = torch.bfloat16, pages: int = 64, seed: int = 0):
        self.layout, self.dtype, self.page_size, self.size = layout, dtype, PS, PS * pages
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = 3, 2, 16, 16
        lf = layout == "layer_first"
        dims = (2, 3, self.size, 2, 16) if lf else (2, self.size, 3, 2, 16)
        raw = torch.randint(0, 256, (*dims[:-1], 16 * dtype.itemsize), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed))  # fmt: skip
        self.kv_buffer = raw.view(dtype)  # arbitrary bit patterns, NaNs included

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = (
            self.kv_buffer[:, :, index : index + PS]
            if self.layout == "layer_first"
            else self.kv_buffer[:, index : index + PS]
        )
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * 3 * PS * 2 * 16, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self.get_data_page(index, flat=False)
        page.copy_(data_page.view(page.shape))

    def zero_pages(self, *numbers: int) -> None:
        for n in numbers:
            self.get_data_page(n * PS, flat=False).zero_()

    def page_bits(self, index: int) -> torch.Tensor:
        return self.get_data_page(index).view(torch.uint8).clone()

    def token_kv(self, slot: int) -> torch.Tensor:
        """[2, layers, heads, dim] of one token slot, whatever the layout (for cross-layout checks)."""
        kv = self.kv_buffer[:, :, slot] if self.layout == "layer_first" else self.kv_buffer[:, slot]
        return kv.contiguous().view(torch.uint8)


def pages(*numbers: int) -> torch.Tensor:
    """Host indices of whole pages, as SGLang hands them to batch_*_v1."""
    return torch.cat([torch.arange(n * PS, (n + 1) * PS) for n in numbers])


def config(
    path: Path, *, tp_rank: int = 0, tp_size: int = 1, model: str = "test/tiny", **extra: Any
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name=model,
        extra_config={**EXTRA, "path": str(path), **extra},
    )  # fmt: skip


@pytest.fixture
def attach(tmp_path: Path) -> Iterator[Callable[..., AgentStateStorage]]:
    """Create a backend the way HiCacheController.attach_storage_backend does; closed at teardown."""
    made: list[AgentStateStorage] = []

    def make(pool: Any, path: Path | None = None, register: bool = True, **kw: Any) -> AgentStateStorage:
        backend = StorageBackendFactory.create_backend("dynamic", config(path or tmp_path / "kv", **kw), pool)
        made.append(backend)
        if register:
            backend.register_mem_pool_host(pool)
        return backend

    yield make
    for backend in made:
        backend.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_set_exists_get_bit_exact_restart(attach: Callable[..., AgentStateStorage], layout: str) -> None:
    pool = StandInHostPool(layout)
    backend = attach(pool)
    assert isinstance(backend, AgentStateStorage)
    keys = ["a0", "a1", "a2", "a3"]
    want = [pool.page_bits(n * PS) for n in range(4)]
    assert backend.batch_set_v1(keys[:2] + keys[3:], pages(0, 1, 3)) == [True, True, True]
    assert backend.batch_exists(keys) == 2  # a2 is the gap: consecutive hits from the start
    assert backend.batch_exists(keys[:2]) == 2 and backend.batch_exists(["zz"] + keys) == 0
    assert backend.batch_set_v1(keys, pages(0, 1, 2, 3)) == [True] * 4  # a0, a1, a3 were there already
    assert backend.counters()["pages_present"] == 3
    pool.zero_pages(10, 11, 12, 13)
    assert backend.batch_get_v1(keys, pages(10, 11, 12, 13)) == [True] * 4
    assert all(pool.page_bits((10 + i) * PS).equal(want[i]) for i in range(4))
    backend.close()

    again = attach(pool)  # a restarted backend on the same path: the host tier is empty, LMDB is not
    assert again.batch_exists(keys) == 4
    assert again.batch_get_v1(keys[::-1], pages(20, 21, 22, 23)) == [True] * 4
    assert all(pool.page_bits((23 - i) * PS).equal(want[i]) for i in range(4))


def test_generic_interface_and_v1_interoperate(attach: Callable[..., AgentStateStorage]) -> None:
    pool = StandInHostPool()
    backend = attach(pool)
    assert backend.batch_set(["g0", "g1"], [pool.get_data_page(0), pool.get_data_page(PS)]) is True
    assert backend.set("g2", pool.get_data_page(2 * PS)) and backend.exists("g2") and not backend.exists("nope")
    got = backend.batch_get(["g0", "g1", "nope"], [pool.get_dummy_flat_data_page() for _ in range(3)])
    assert got[2] is None and got[0] is not None and got[1] is not None
    assert got[0].view(torch.uint8).equal(pool.page_bits(0)) and got[1].view(torch.uint8).equal(pool.page_bits(PS))
    assert backend.batch_get_v1(["g2"], pages(30)) == [True] and pool.page_bits(30 * PS).equal(pool.page_bits(2 * PS))
    assert backend.batch_set_v1(["v5"], pages(5)) == [True]
    fresh = backend.get("v5")  # no target: a page is allocated
    assert fresh is not None and fresh.view(torch.uint8).equal(pool.page_bits(5 * PS))
    pool.set_from_flat_data_page(40 * PS, fresh)
    assert pool.page_bits(40 * PS).equal(pool.page_bits(5 * PS))
    assert backend.clear() is True and backend.batch_exists(["g0"]) == 0 and backend.get("v5") is None


def test_stored_pages_are_canonical_across_layouts(attach: Callable[..., AgentStateStorage], tmp_path: Path) -> None:
    first, layered = StandInHostPool("page_first", seed=1), StandInHostPool("layer_first", seed=2)
    writer = attach(first)
    assert writer.batch_set_v1(["x0", "x1"], pages(2, 3)) == [True, True]
    writer.close()
    reader = attach(layered, path=tmp_path / "kv")  # same fingerprint and path, other host layout
    assert reader.batch_get_v1(["x0", "x1"], pages(7, 8)) == [True, True]
    assert all(layered.token_kv(7 * PS + t).equal(first.token_kv(2 * PS + t)) for t in range(2 * PS))


def test_corrupt_page_is_a_miss_not_wrong_bytes(attach: Callable[..., AgentStateStorage], tmp_path: Path) -> None:
    pool = StandInHostPool()
    backend = attach(pool)
    keys = ["c0", "c1", "c2"]
    assert backend.batch_set_v1(keys, pages(0, 1, 2)) == [True] * 3
    stored = backend.storage_key("c1").encode()
    backend.close()
    (rank_dir,) = (tmp_path / "kv").iterdir()
    env = lmdb.open(str(rank_dir / "chunks"), map_size=64 << 20, subdir=True)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(stored))
        value[100] ^= 0x01  # one bit of the payload
        txn.put(stored, bytes(value))
    env.close()

    again = attach(pool)
    before = pool.page_bits(20 * PS)
    assert again.batch_get_v1(keys, pages(19, 20, 21)) == [True, False, True]
    assert pool.page_bits(20 * PS).equal(before)  # the corrupt page never reached the pool
    assert pool.page_bits(19 * PS).equal(pool.page_bits(0)) and pool.page_bits(21 * PS).equal(pool.page_bits(2 * PS))
    assert again.counters()["corrupt"] == 1
    assert again.batch_exists(keys) == 1  # the corrupt copy was dropped, so SGLang recomputes and rewrites it
    assert again.batch_set_v1(keys, pages(0, 1, 2)) == [True] * 3 and again.batch_exists(keys) == 3


def test_many_threads_at_once(attach: Callable[..., AgentStateStorage]) -> None:
    pool = StandInHostPool(pages=128)
    backend = attach(pool)
    threads, errors = 8, []
    barrier = threading.Barrier(threads)

    def worker(t: int) -> None:
        try:
            keys = [f"t{t}p{i}" for i in range(4)] + ["shared"]  # every thread also writes one common page
            src = [4 * t + i for i in range(4)] + [120]
            barrier.wait()
            assert backend.batch_set_v1(keys, pages(*src)) == [True] * 5
            assert backend.batch_exists(keys) == 5
            assert backend.batch_get_v1(keys[:4], pages(*[64 + 4 * t + i for i in range(4)])) == [True] * 4
            assert all(
                pool.page_bits((64 + 4 * t + i) * PS).equal(pool.page_bits(s * PS)) for i, s in enumerate(src[:4])
            )
        except BaseException as exc:  # noqa: BLE001 - reported below: an assert in a thread would be lost
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    assert backend.batch_exists(["shared"]) == 1 and backend.batch_get_v1(["shared"], pages(127)) == [True]
    assert pool.page_bits(127 * PS).equal(pool.page_bits(120 * PS))


def test_reads_in_the_callers_thread_never_serve_a_buffer_reused_under_them(
    attach: Callable[..., AgentStateStorage], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pages the host tier holds are copied in SGLang's own thread (`ChunkStore.read_held`), beside
    the store's loop, which meanwhile evicts them and hands their buffers to the next encodes (the
    arena). A host tier of about 12 pages, a writer storing new pages without pause, readers reading
    16 pages again and again: every page reported read holds exactly its own bytes."""
    import agentstate.arena

    monkeypatch.setattr(agentstate.arena, "MIN_BYTES", 1024)  # these 1.6 KB pages are recycled too
    pool = StandInHostPool(pages=128, seed=3)
    backend = attach(pool, host_capacity_bytes=12 * 1600, host_arena_bytes=1 << 20)
    fixed = [f"r{i}" for i in range(16)]
    assert backend.batch_set_v1(fixed, pages(*range(16))) == [True] * 16  # pages 0..15: what readers check
    stop = threading.Event()
    errors: list[BaseException] = []
    served = [0, 0]  # pages read, and those the host tier still held (read in the caller's thread)

    def writer() -> None:
        n = 0
        while not stop.is_set():
            keys = [f"w{n}-{j}" for j in range(4)]
            n += 1
            if backend.batch_set_v1(keys, pages(*(16 + (n + j) % 32 for j in range(4)))) != [True] * 4:
                errors.append(AssertionError(f"write {n} failed"))

    def reader(t: int) -> None:
        dest = [64 + 16 * t + i for i in range(16)]
        try:
            for _ in range(40):
                pool.zero_pages(*dest)
                held = backend.store.chunks.in_memory  # type: ignore[union-attr]
                before = sum(held(backend.storage_key(k)) for k in fixed)
                got = backend.batch_get_v1(fixed, pages(*dest))
                served[0] += sum(got)
                served[1] += before
                for i, ok in enumerate(got):
                    assert ok, f"page {i} unread: LMDB holds every one"
                    assert pool.page_bits(dest[i] * PS).equal(pool.page_bits(i * PS)), f"page {i}: wrong bytes"
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads[1:]:
        th.join()
    stop.set()
    threads[0].join()
    assert errors == []
    assert served[0] == 3 * 40 * 16 and served[1] > 0  # some from host memory, under eviction
    arena = backend.store.chunks.backend("host").arena.stats()  # type: ignore[union-attr, attr-defined]
    assert arena.reused > 0  # evicted buffers did serve new values meanwhile


def test_tp_rank_and_dtype_never_collide(attach: Callable[..., AgentStateStorage], tmp_path: Path) -> None:
    bf16, fp16 = StandInHostPool(dtype=torch.bfloat16), StandInHostPool(dtype=torch.float16)
    first = attach(bf16)
    assert first.batch_set_v1(["k0", "k1"], pages(0, 1)) == [True, True]
    names = {first.storage_key("k0")}
    first.close()
    with pytest.raises(SpecMismatchError, match="dtype 'float16' != 'bfloat16'"):
        attach(fp16)  # the same rank directory records the bf16 spec: another dtype is refused, naming it
    for pool, rank, path in ((fp16, 0, tmp_path / "fp16"), (bf16, 1, None)):  # same SGLang keys
        other = attach(pool, path=path, tp_rank=rank, tp_size=2 if rank else 1)
        assert other.batch_exists(["k0", "k1"]) == 0 and other.batch_get_v1(["k0"], pages(5)) == [False]
        names.add(other.storage_key("k0"))
        other.close()
    assert len(names) == 3


def test_shared_remote_tier_keeps_ranks_apart(attach: Callable[..., AgentStateStorage], tmp_path: Path,
                                              redis_server: Any) -> None:  # fmt: skip
    tiers = [{"kind": "host"}, {"kind": "lmdb"}, {"kind": "redis", "url": redis_server.url}]
    model = f"test/{uuid.uuid4().hex[:8]}"  # the session's redis outlives this test
    pool = StandInHostPool()
    rank0 = attach(pool, path=tmp_path / "a", tiers=tiers, model=model, tp_size=2)
    rank1 = attach(pool, path=tmp_path / "a", tiers=tiers, model=model, tp_rank=1, tp_size=2)
    assert rank0.batch_set_v1(["r0", "r1"], pages(0, 1)) == [True, True]
    assert rank1.batch_exists(["r0", "r1"]) == 0  # same SGLang keys, same redis: another rank's shard
    elsewhere = attach(pool, path=tmp_path / "b", tiers=tiers, model=model, tp_size=2)  # rank 0 on another host
    assert elsewhere.batch_exists(["r0", "r1"]) == 2
    assert elsewhere.batch_get_v1(["r0", "r1"], pages(8, 9)) == [True, True]
    assert pool.page_bits(8 * PS).equal(pool.page_bits(0)) and pool.page_bits(9 * PS).equal(pool.page_bits(PS))


def test_bad_input_answers_false_never_raises(attach: Callable[..., AgentStateStorage]) -> None:
    pool = StandInHostPool()
    early = attach(pool, register=False)  # no pool registered yet
    assert early.batch_exists(["a"]) == 0 and early.batch_set_v1(["a"], pages(0)) == [False]
    assert early.get("a") is None and early.exists("a") is False and early.batch_get_v1(["a"], pages(0)) == [False]
    early.close()

    backend = attach(pool)
    bad: list[Any] = ["ok", None, "../x", "a/b", "", 7]
    assert backend.batch_set_v1(bad, pages(0, 1, 2, 3, 4, 5)) == [True] + [False] * 5
    assert backend.batch_get_v1(bad, pages(6, 7, 8, 9, 10, 11)) == [True] + [False] * 5
    assert backend.batch_exists(["ok", "a/b", "ok"]) == 1
    assert backend.batch_set_v1(["a", "b"], None) == [False, False]  # type: ignore[arg-type]
    assert backend.batch_get_v1(["a", "b"], None) == [False, False]  # type: ignore[arg-type]
    assert backend.batch_set_v1(["a", "b"], pages(0)) == [False, False]  # too few indices
    assert backend.batch_set_v1(["a", "b"], torch.tensor([0, 1, 2, 3, 10_000, 10_001, 10_002, 10_003])) == [True, False]
    assert backend.batch_set(["a"], None) is False and backend.batch_set(["a"], [torch.zeros(3)]) is False
    assert backend.set("w", torch.zeros(2 * 3 * PS * 2 * 16, dtype=torch.float16)) is False  # wrong dtype
    assert backend.get("ok", torch.zeros(5, dtype=torch.bfloat16)) is None  # target of the wrong size
    assert backend.batch_get(["ok"], None)[0] is not None and backend.batch_get(None) == []  # type: ignore[arg-type]
    hit = backend.batch_exists_v2(["ok", "../x"])  # v2 without extra pools: the KV pages' hit (the bad key ends it)
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (1, [1])
    assert backend.batch_set_v2(None) == {} and backend.batch_get_v2([object()]) == {}  # type: ignore[arg-type]
    assert backend.batch_exists_v2(["ok"], [object()]).kv_hit_pages == 0  # type: ignore[list-item]
    counts = backend.counters()
    assert counts["bad_pages"] >= 10 and counts["errors"] >= 4
    backend.close()
    backend.close()
    assert backend.batch_exists(["ok"]) == 0 and backend.batch_get_v1(["ok"], pages(0)) == [False]
    assert backend.batch_set_v1(["ok"], pages(0)) == [False] and backend.clear() is False


CHILD = TORCHVISION_PLACEHOLDER + r"""
import torch
try:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
except ModuleNotFoundError as exc:
    print("SKIP " + json.dumps(exc.name)); sys.exit(0)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from agentstate.adapters.sglang_pages import PageLayout
root, extra = sys.argv[1], json.loads(sys.argv[2])
common = dict(host_to_device_ratio=2.0, host_size=0, page_size=4, pin_memory=False, device="cpu",
              device_capacity_tokens=64, start_layer=0, end_layer=3)

def host_pool(kind, layout, seed):
    if kind == "mha":
        device = MHATokenToKVPool(size=64, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=16, layer_num=3,
                                  device="cpu", enable_memory_saver=False, enable_alt_stream=False)
        host = MHATokenToKVPoolHost(device._mha_buffer_info(), layout=layout, **common)
    else:
        device = MLATokenToKVPool(size=64, page_size=4, dtype=torch.bfloat16, kv_lora_rank=32, qk_rope_head_dim=16,
                                  layer_num=3, device="cpu", enable_memory_saver=False)
        host = MLATokenToKVPoolHost(device._mla_buffer_info(), layout=layout, target_layer_num=3, **common)
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return host

def token(host, slot):  # the KV of one token slot, read from SGLang's own buffer layout: MHA [2, L, H, D], MLA [L, 1, D]
    kv, p, o, mla = host.kv_buffer, slot // 4, slot % 4, hasattr(host, "kv_cache_dim")
    got = {"layer_first": lambda: kv[:, slot] if mla else kv[:, :, slot],
           "page_first": lambda: kv[slot] if mla else kv[:, slot],
           "page_first_direct": lambda: kv[p, :, o] if mla else kv[:, p, :, o],
           "page_head": lambda: kv[:, p, :, o].permute(0, 2, 1, 3)}[host.layout]()
    return got.contiguous().view(torch.uint8)

def attach(host, path, rank=0, size=1):
    cfg = HiCacheStorageConfig(tp_rank=rank, tp_size=size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=hasattr(host, "kv_cache_dim"), enable_storage_metrics=False,
        is_page_first_layout=host.layout == "page_first", model_name="test/real-pool", extra_config={**extra, "path": path})
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    backend.register_mem_pool_host(host)
    return backend

def bits(host, slot):  # one page, bytes in the host pool's own flat order
    return host.get_data_page(slot).view(torch.uint8).clone()

out = {}
keys = ["k0", "k1", "k2"]
layouts = {"mha": ["layer_first", "page_first", "page_first_direct", "page_head"],
           "mla": ["layer_first", "page_first", "page_first_direct"]}
for kind, names in layouts.items():
    for n, layout in enumerate(names):
        host = host_pool(kind, layout, n)
        idx = host.alloc(24)  # six pages from the pool's own allocator
        src, dst = idx[:12], idx[12:]
        want = [bits(host, int(src[4 * i])) for i in range(3)]
        path = f"{root}/{kind}-{layout}"
        backend = attach(host, path)
        view = PageLayout.of(host).pool_view(host)  # pages as slices of one view of the pool, where it has one
        r = {"type": type(host).__name__, "pool_view": view is not None, "set": backend.batch_set_v1(keys, src),
             "exists": backend.batch_exists(keys + ["gap"]), "get": backend.batch_get_v1(keys, dst)}
        r["exact"] = all(bits(host, int(dst[4 * i])).equal(want[i]) for i in range(3))
        backend.close()
        again = attach(host, path)
        r["exists_after_restart"] = again.batch_exists(keys)
        r["get_after_restart"] = again.batch_get_v1(keys[::-1], dst)
        r["exact_after_restart"] = all(bits(host, int(dst[4 * (2 - i)])).equal(want[i]) for i in range(3))
        again.close()
        out[f"{kind}/{layout}"] = r
    # pages stored from a page_first pool, loaded into pools of every other layout (one store path)
    first = host_pool(kind, "page_first", 7)
    a = attach(first, f"{root}/{kind}-cross"); a.batch_set_v1(keys, torch.arange(0, 12)); a.close()
    for layout in names:
        other = host_pool(kind, layout, 8)
        b = attach(other, f"{root}/{kind}-cross"); got = b.batch_get_v1(keys, torch.arange(20, 32)); b.close()
        same = all(token(other, 20 + t).equal(token(first, t)) for t in range(12))
        out[f"{kind}/cross/{layout}"] = {"get": got, "exact": same}
# a pool whose pages are not slices of its kv_buffer (here: copies) gets no whole-pool view
odd = host_pool("mha", "layer_first", 10)
real = odd.get_data_page
odd.get_data_page = lambda i, flat=True: real(i, flat).clone()
out["copied_pages_view"] = PageLayout.of(odd).pool_view(odd) is not None
mla = host_pool("mla", "page_first", 9)  # MLA KV is replicated: every TP rank has one fingerprint
ranks = [attach(mla, f"{root}/mla-ranks", rank, 2) for rank in (0, 1)]
out["mla_rank_keys_equal"] = ranks[0].storage_key("k") == ranks[1].storage_key("k")
for r in ranks:
    r.close()
print("RESULT " + json.dumps(out))
"""


def test_real_host_pool(tmp_path: Path) -> None:
    """SGLang's real device pools (on cpu) and host pools, every MHA and MLA layout, through the factory."""
    results = run_child(CHILD, str(tmp_path), json.dumps(EXTRA))
    runs = [k for k in results if k.count("/") == 1]
    assert len(runs) == 7  # MHA: 4 layouts, MLA: 3
    for name in runs:
        r = results[name]
        assert r["type"] == ("MHATokenToKVPoolHost" if name.startswith("mha") else "MLATokenToKVPoolHost")
        assert r["set"] == [True] * 3 and r["exists"] == 3 and r["get"] == [True] * 3 and r["exact"], (name, r)
        assert r["exists_after_restart"] == 3 and r["get_after_restart"] == [True] * 3 and r["exact_after_restart"]
        assert results[name.replace("/", "/cross/")] == {"get": [True] * 3, "exact": True}, name
    assert results["mla_rank_keys_equal"] is True
    # the whole-pool view (one narrow per page) is what layer_first and page_first MHA pools read and
    # write through above, so their exactness covers it; a pool it does not match falls back
    assert {n for n in runs if results[n]["pool_view"]} == {"mha/layer_first", "mha/page_first"}
    assert results["copied_pages_view"] is False
