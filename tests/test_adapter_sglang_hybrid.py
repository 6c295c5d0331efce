"""SGLang's v2 storage interface for hybrid models (Mamba states, sliding-window pages), against SGLang's
own host pool classes on CPU: a KV pool (`MHATokenToKVPoolHost`), a Mamba pool (`MambaPoolHost`, one
state per slot) and an SWA pool, attached through SGLang's backend factory, with SGLang's own
`PoolTransfer` / `PoolName` / `PoolHitPolicy` as its hybrid cache controller sends them.

A real SGLang server cannot run a hybrid model on this CPU install: Qwen3-Next's GDN layers need
`sgl_kernel.mamba` (a CPU build of sgl_kernel that PyPI does not carry, and no torch fallback), Mamba2
models have no CPU conv kernel, and SGLang runs Gemma 3 with its hybrid SWA memory off (a dense model,
the v1 path). So the pools are SGLang's real classes, driven as the controller drives them (a full-server test
needs a GPU machine: not written yet).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.requires import require_module
from tests.sglang_child import TORCHVISION_PLACEHOLDER, run_child

require_module("sglang.srt.mem_cache.storage.backend_factory", "install requirements-sglang.txt as .ci/run does")

EXTRA = {"backend_name": "agentstate", "module_path": "agentstate.adapters.sglang", "class_name": "AgentStateStorage",
         "interface_v1": 1, "lmdb_map_size": 64 << 20, "host_capacity_bytes": 64 << 20}  # fmt: skip

CHILD = TORCHVISION_PLACEHOLDER + r"""
import torch
try:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
except ModuleNotFoundError as exc:
    print("SKIP " + json.dumps(exc.name)); sys.exit(0)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
root, extra = sys.argv[1], json.loads(sys.argv[2])
PS = 4
common = dict(host_to_device_ratio=2.0, host_size=0, page_size=PS, pin_memory=False, device="cpu",
              device_capacity_tokens=64, start_layer=0, end_layer=2)

def fill(t, seed):
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))

def kv_pool(seed, heads=2):
    device = MHATokenToKVPool(size=64, page_size=PS, dtype=torch.bfloat16, head_num=heads, head_dim=16, layer_num=2,
                              device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    host = MHATokenToKVPoolHost(device._mha_buffer_info(), layout="page_first", **common)
    fill(host.kv_buffer, seed)
    return host

def mamba_pool(seed, ssm=16):
    info = MambaStateBufferInfo(temporal=torch.zeros(2, 8, 2, ssm, 16), conv=(torch.zeros(2, 8, 3, 32, dtype=torch.bfloat16),))
    host = MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, device="cpu", layout="page_first")
    for slot in range(host.size):
        page = torch.randint(0, 256, (host.size_per_token,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed * 100 + slot))
        host.set_from_flat_data_page(slot, page)
    return host

def attach(pools, path):
    kv = pools["kv"]
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True, model_name="test/hybrid",
        extra_config={**extra, "path": path})
    backend = StorageBackendFactory.create_backend("dynamic", cfg, kv)
    backend.register_mem_pool_host(kv)
    for name, pool in pools.items():  # as the hybrid controller registers them: the KV pool too
        backend.register_mem_host_pool_v2(pool, {"kv": PoolName.KV, "mamba": PoolName.MAMBA, "swa": PoolName.SWA}[name])
    backend.on_host_pools_registered()
    return backend

def page(pool, slot):
    return pool.get_data_page(slot, flat=True).contiguous().view(torch.uint8).clone()

def mamba(keys, slots=None):
    return PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.TRAILING_PAGES,
                        host_indices=None if slots is None else torch.tensor(slots, dtype=torch.int64))

def swa(keys, start=None):
    idx = None if start is None else torch.arange(start, start + PS * len(keys), dtype=torch.int64)
    return PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.TRAILING_PAGES, host_indices=idx)

def exists(backend, keys, transfers):
    r = backend.batch_exists_v2(keys, transfers)
    return {"kv": r.kv_hit_pages, "pools": {str(k): v for k, v in r.extra_pool_hit_pages.items()},
            "restorable": r.restorable_prefix_pages}

out = {}
keys = [f"{i:02x}" * 8 for i in range(8)]  # SGLang's page keys are hex hashes
path = f"{root}/d"
pools = {"kv": kv_pool(1), "mamba": mamba_pool(1), "swa": kv_pool(2)}
b = attach(pools, path)
out["set_kv"] = b.batch_set_v1(keys, torch.arange(0, 8 * PS))
# the controller's backups: one Mamba state per radix node (after pages 4 and 8), the last 2 SWA pages
out["set_mamba"] = [b.batch_set_v2([mamba([keys[3]], [2])]), b.batch_set_v2([mamba([keys[7]], [5])])]
out["set_swa"] = b.batch_set_v2([swa(keys[6:8], 6 * PS)])
want = {"m4": page(pools["mamba"], 2), "m8": page(pools["mamba"], 5),
        "swa": [page(pools["swa"], (6 + i) * PS) for i in range(2)]}
holder = ["__placeholder__"]
out["exists_mamba"] = exists(b, keys, [mamba(holder)])
out["exists_both"] = exists(b, keys, [mamba(holder), swa(holder * 2)])
out["exists_short"] = exists(b, keys[:6], [mamba(holder)])
out["exists_unknown_policy"] = exists(b, keys, [PoolTransfer(name=PoolName.MAMBA, keys=holder, hit_policy=PoolHitPolicy.BLOCK_GROUPS)])
out["exists_unregistered"] = exists(b, keys, [PoolTransfer(name=PoolName.INDEXER, keys=holder, hit_policy=PoolHitPolicy.ALL_PAGES)])
# hostile calls: host indices that are not one page per key, a key that is no hash, an unregistered pool
out["bad_indices"] = b.batch_set_v2([mamba([keys[0]], [1, 2])])
out["bad_key"] = b.batch_set_v2([mamba(["../etc"], [1])])
out["unregistered"] = b.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, keys=[keys[0]], host_indices=torch.tensor([0]))])
out["after_bad"] = exists(b, keys[:4], [mamba(holder)])  # nothing was stored by them
b.close()

# a new process's pools (other bytes), the same directory: the states and pages come back bit for bit
fresh = {"kv": kv_pool(3), "mamba": mamba_pool(3), "swa": kv_pool(4)}
b = attach(fresh, path)
out["restart_exists"] = exists(b, keys, [mamba(holder), swa(holder * 2)])
out["get_kv"] = b.batch_get_v1(keys, torch.arange(0, 8 * PS))
out["get"] = b.batch_get_v2([mamba([keys[7]], [1]), swa(keys[6:8], 10 * PS)])
out["exact"] = page(fresh["mamba"], 1).equal(want["m8"]) and all(
    page(fresh["swa"], (10 + i) * PS).equal(want["swa"][i]) for i in range(2))
out["get_m4"] = b.batch_get_v2([mamba([keys[3]], [4])])
out["exact_m4"] = page(fresh["mamba"], 4).equal(want["m4"])
out["get_missing"] = b.batch_get_v2([mamba([keys[5]], [6])])
out["untouched"] = page(fresh["mamba"], 6).equal(page(mamba_pool(3), 6))
# damage the stored state after page 8 in LMDB, under the store (as a disk would): a miss, the slot left as it was
victim = b._extra["mamba"].key(keys[7])
raw = b._run(b.store.chunks.raw_value("lmdb", victim))
bad = bytearray(raw); bad[-3] ^= 0x10
b._run(b.store.chunks.backend("lmdb").put([victim], [bytes(bad)]))
b.close()
b = attach({"kv": kv_pool(5), "mamba": mamba_pool(5), "swa": kv_pool(6)}, path)
before = page(b.registered_pools[PoolName.MAMBA], 0).clone()
out["get_damaged"] = b.batch_get_v2([mamba([keys[7]], [0])])
out["damaged_untouched"] = page(b.registered_pools[PoolName.MAMBA], 0).equal(before)
out["counters"] = {k: v for k, v in b.counters().items() if "pool" in k or k in ("corrupt", "errors")}
b.close()
# another model's Mamba pool (other state shapes): a spec of its own, no hits on these states
other = attach({"kv": kv_pool(7), "mamba": mamba_pool(7, ssm=8), "swa": kv_pool(8)}, path)
out["other_model"] = exists(other, keys, [mamba(holder)])
other.close()
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_child(CHILD, str(tmp_path_factory.mktemp("sglang-hybrid")), json.dumps(EXTRA))

def test_backups_and_the_hit_query(results: dict[str, Any]) -> None:
    """KV pages through v1, Mamba states (after pages 4 and 8) and the last two SWA pages through v2;
    the hit query answers every prefix the pools can restore: a Mamba state only at its boundaries,
    the SWA window only where both of its trailing pages are stored."""
    r = results
    assert r["set_kv"] == [True] * 8
    assert r["set_mamba"] == [{"mamba": [True]}, {"mamba": [True]}] and r["set_swa"] == {"swa": [True, True]}
    assert r["exists_mamba"] == {"kv": 8, "pools": {"kv": 8, "mamba": 8}, "restorable": [4, 8]}
    assert r["exists_both"] == {"kv": 8, "pools": {"kv": 8, "mamba": 8, "swa": 8}, "restorable": [8]}
    assert r["exists_short"] == {"kv": 4, "pools": {"kv": 6, "mamba": 4}, "restorable": [4]}  # KV to 6, a state at 4
    for name in ("exists_unknown_policy", "exists_unregistered"):  # a pool it cannot answer for: no hit
        assert r[name]["kv"] == 0 and r[name]["restorable"] == [], (name, r[name])


def test_hostile_calls_store_nothing(results: dict[str, Any]) -> None:
    r = results
    assert r["bad_indices"] == {"mamba": [False]} and r["bad_key"] == {"mamba": [False]}
    assert r["unregistered"] == {"indexer": [False]}
    assert r["after_bad"] == {"kv": 4, "pools": {"kv": 4, "mamba": 4}, "restorable": [4]}


def test_states_and_pages_come_back_bit_for_bit_after_a_restart(results: dict[str, Any]) -> None:
    r = results
    assert r["restart_exists"]["restorable"] == [8]
    assert r["get_kv"] == [True] * 8 and r["get"] == {"mamba": [True], "swa": [True, True]} and r["exact"]
    assert r["get_m4"] == {"mamba": [True]} and r["exact_m4"]
    assert r["get_missing"] == {"mamba": [False]} and r["untouched"]


def test_a_damaged_state_is_a_miss_and_another_models_states_never_hit(results: dict[str, Any]) -> None:
    r = results
    assert r["get_damaged"] == {"mamba": [False]} and r["damaged_untouched"]
    assert r["counters"].get("corrupt", 0) >= 1
    assert r["other_model"]["restorable"] == [] and r["other_model"]["pools"]["mamba"] == 0

