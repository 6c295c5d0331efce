"""The vLLM connector under vLLM's own `Scheduler`, in this process (issue 25, items 1 and 2).

vLLM's real v1 `Scheduler` loads the connector by module path (`kv_connector_module_path`), as an
engine does; the worker side is the connector's WORKER instance in this process, on real tensors
laid out as vLLM's CPU backend lays out its KV caches. `Engine.step` plays the model runner: it
hands the step's metadata to the worker, writes into the scheduled blocks the KV "computed" for
their tokens (`kv_of`: a function of token and position, so any block can be checked against the
tokens it was meant to hold), lets the worker save, and reports what vLLM's model runner would.

A slow store is a store whose event loop is busy (as under a slow tier); `Engine.stall` makes it
busy on purpose: the loop runs a callback that waits until the test lets it go, so what the
connector copies out of the blocks is copied after whatever the engine did meanwhile.

Runs under the venv that has vLLM (.ci/run makes .venv-ci-vllm); CI fails instead of skipping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.requires import require_module

vllm = require_module("vllm", "pip install -c constraints.txt -r requirements-vllm.txt (a venv of its own: .ci/run)")

from agentstate import ModelSpec, StateStore
from agentstate.codec import decode
from agentstate.keys import chunk_keys, namespace_for

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from vllm_engine import make_model

BS = 128  # vLLM's CPU block size
CHUNK = 128
LAYERS, HEADS, DIM = 2, 2, 64  # make_model's defaults
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
LONG = 100_000  # characters of a hostile value


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def kv_of(tokens: list[int], start: int = 0) -> torch.Tensor:
    """The KV the test's "model" computes for `tokens` at positions start.., canonical
    [layers, 2, n, heads, dim]; every value exact in float32 and distinct per token and position."""
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(start, start + len(tokens), dtype=torch.float32)
    base = torch.remainder(t * 7 + pos * 13, 1009)  # [n]
    layer = torch.arange(LAYERS, dtype=torch.float32).view(LAYERS, 1, 1, 1, 1) * 0.5
    plane = torch.arange(2, dtype=torch.float32).view(1, 2, 1, 1, 1) * 0.25
    head = torch.arange(HEADS, dtype=torch.float32).view(1, 1, 1, HEADS, 1) * 0.125
    dim = torch.arange(DIM, dtype=torch.float32).view(1, 1, 1, 1, DIM) / 1024
    return base.view(1, 1, -1, 1, 1) + layer + plane + head + dim


def write_blocks(caches: list[torch.Tensor], blocks: list[int], start: int, kv: torch.Tensor) -> None:
    """Write canonical KV of positions start.. into the blocks as vLLM's CPU kernels lay it out:
    per (block, head) K transposed [dim, block_size], then V [block_size, dim] (written here from
    that description, not through the connector's own layout code)."""
    for i in range(kv.shape[2]):
        t = start + i
        block, slot = blocks[t // BS], t % BS
        for layer, cache in enumerate(caches):
            for h in range(HEADS):
                flat = cache[block, h].view(-1)
                flat[: DIM * BS].view(DIM, BS)[:, slot] = kv[layer, 0, i, h]
                flat[DIM * BS :].view(BS, DIM)[slot] = kv[layer, 1, i, h]


class Records(logging.Handler):
    """What the connector logs (vLLM's logger does not propagate to the root: pytest's caplog misses it)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("vllm.agentstate")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model(str(tmp_path_factory.mktemp("vllm-sched") / "model"))


class Engine:
    """vLLM's Scheduler with the connector loaded by module path, and the connector's worker side in
    this process on real CPU-layout KV caches of `num_blocks` blocks (block 0 is vLLM's null block)."""

    def __init__(self, model: str, data: Path, num_blocks: int, **extra: Any) -> None:
        from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from agentstate.adapters.vllm import AgentStateConnector

        kv = KVTransferConfig(kv_connector="AgentStateConnector", kv_role="kv_both",
                              kv_connector_module_path="agentstate.adapters.vllm",
                              kv_connector_extra_config={"path": str(data), "chunk_tokens": CHUNK, **extra})  # fmt: skip
        self.config = VllmConfig(
            model_config=ModelConfig(model=model, dtype="float32", max_model_len=2048, seed=0, skip_tokenizer_init=True),
            cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=2048,
                                             enable_chunked_prefill=False, is_encoder_decoder=False),
            kv_transfer_config=kv,
        )  # fmt: skip
        assert self.config.cache_config.block_size == BS
        self.config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32)
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)])  # fmt: skip
        self.scheduler = Scheduler(self.config, kv_cache_config, StructuredOutputManager(self.config), block_size=BS,
                                   log_stats=True)  # fmt: skip
        assert type(self.scheduler.connector) is AgentStateConnector  # loaded by module path
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BS, sha256)
        # the worker: what vLLM's CPU model runner registers (one tensor per layer, CPU_ATTN backend)
        self.caches = [torch.zeros(num_blocks, HEADS, BS, 2 * DIM) for _ in LAYER_NAMES]
        self.config.compilation_config.static_forward_context.update(
            {n: SimpleNamespace(attn_backend=CPUAttentionBackend) for n in LAYER_NAMES}
        )
        self.worker = AgentStateConnector(self.config, KVConnectorRole.WORKER, kv_cache_config)
        self.worker.register_kv_caches(dict(zip(LAYER_NAMES, self.caches)))
        self.finished: set[str] = set()

    def add(self, req_id: str, tokens: list[int], params: dict[str, Any] | None = None, max_tokens: int = 1) -> None:
        self.scheduler.add_request(self.request(req_id, tokens, params, max_tokens))

    def request(self, req_id: str, tokens: list[int], params: dict[str, Any] | None = None, max_tokens: int = 1) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": params} if params is not None else None
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        return Request(req_id, list(tokens), sp, None, block_hasher=self.hasher)

    def step(self) -> Any:
        """One engine step: schedule, the worker's load/forward/save, and the model runner's output."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        ids = list(out.num_scheduled_tokens)
        for req_id, n in out.num_scheduled_tokens.items():  # the forward: KV of the scheduled tokens
            req = self.scheduler.requests[req_id]
            start = req.num_computed_tokens - n  # schedule() advanced it already
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            write_blocks(self.caches, blocks, start, kv_of(list(req.all_token_ids[start : start + n]), start))
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(out.finished_req_ids)
        invalid = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        sampled = []
        for req_id in ids:
            req = self.scheduler.requests[req_id]
            sampled.append([5] if req.num_computed_tokens >= req.num_tokens else [])
        runner = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                                  invalid_block_ids=invalid),
        )  # fmt: skip
        self.scheduler.update_from_output(out, runner)
        for req_id in ids:
            req = self.scheduler.requests.get(req_id)
            if req is None or req.is_finished():
                self.finished.add(req_id)
        return out

    def run_until(self, done: Any, what: str, limit_s: float = 120) -> None:
        """Step until `done()`: a hang guard (no timing is asserted)."""
        deadline = time.monotonic() + limit_s
        while not done():
            assert time.monotonic() < deadline, f"engine never got to: {what}"
            self.step()
            time.sleep(0.005)

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        """The store's loop busy (a slow tier): nothing on it runs until the block exits."""
        go, busy = threading.Event(), threading.Event()

        def block() -> None:
            busy.set()
            go.wait(300)

        self.worker.worker.loop.loop.call_soon_threadsafe(block)
        assert busy.wait(30)
        try:
            yield
        finally:
            go.set()

    def close(self) -> None:
        self.worker.shutdown()  # waits for the writes in flight


def stored_chunks(data: Path, tokens: list[int]) -> list[torch.Tensor | None]:
    """Each whole chunk of `tokens` as stored (None where none is), read through the store's codec."""
    spec = ModelSpec.model_validate_json((data / "spec.json").read_text())

    async def read() -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        async with StateStore.open(data, spec, chunk_tokens=CHUNK, read_only=True) as store:
            keys = chunk_keys(tokens, namespace=namespace_for("default"), fingerprint=spec.fingerprint,
                              chunk_tokens=CHUNK)  # fmt: skip
            for key in keys:
                value = await store.chunks.read_value(key, CHUNK)
                out.append(None if value is None else decode(value, key=key, fingerprint=spec.fingerprint,
                                                             dtype=spec.torch_dtype,
                                                             shape=tuple(spec.empty_kv(CHUNK).shape)))  # fmt: skip
        return out

    return asyncio.run(read())


def test_bad_session_id_never_frees_blocks_still_being_saved(model: str, tmp_path: Path, records: Records) -> None:
    """Issue 25 item 1. Request 1 names an invalid session id (100,000 characters) and finishes while
    the store's loop is busy, its chunks not yet copied out of its blocks. The pool has room for one
    request: request 2 can only run in request 1's blocks. vLLM must not get them back before the
    copies are done (request_finished answers delay_free=True), so every chunk stored under request
    1's keys holds request 1's KV and request 2's chunks hold request 2's. The bad id is logged once,
    cut; the worker keeps nothing of either request afterwards."""
    data = tmp_path / "data"
    engine = Engine(model, data, num_blocks=4, lookup_timeout_s=0.3)
    p1, p2 = toks(300, 1), toks(300, 2)
    bad = {"agentstate": {"session_id": "x" * LONG + "!", "state": {"turn": 1}}}
    try:
        engine.add("r1", p1, bad)
        out = engine.scheduler.schedule()  # a miss: nothing stored yet
        assert out.num_scheduled_tokens == {"r1": 300}
        with engine.stall():
            # the rest of step 1 by hand: forward, saves handed to the (busy) loop, r1 finishes
            engine.worker.bind_connector_metadata(out.kv_connector_metadata)
            engine.worker.start_load_kv(None)  # type: ignore[arg-type]
            write_blocks(engine.caches, engine.scheduler.kv_cache_manager.get_block_ids("r1")[0], 0, kv_of(p1))
            engine.worker.wait_for_save()
            sending, recving = engine.worker.get_finished(out.finished_req_ids)
            engine.worker.clear_connector_metadata()
            from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

            engine.scheduler.update_from_output(out, ModelRunnerOutput(
                req_ids=["r1"], req_id_to_index={"r1": 0}, sampled_token_ids=[[5]],
                kv_connector_output=KVConnectorOutput(finished_sending=sending, finished_recving=recving)))  # fmt: skip
            # r1 finished; vLLM keeps a request whose blocks the connector holds (delay_free=True)
            held_at_end = "r1" in engine.scheduler.requests
            free_at_end = engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
            engine.add("r2", p2)
            for _ in range(2):  # r2 cannot be given r1's blocks while the store still copies out of them
                engine.step()
            r2_ran_in_stall = "r2" in engine.finished or engine.scheduler.requests["r2"].num_computed_tokens > 0
        engine.run_until(lambda: "r1" not in engine.scheduler.requests, "r1's blocks released")
        engine.run_until(lambda: "r2" in engine.finished and "r2" not in engine.scheduler.requests, "r2 finished")
    finally:
        engine.close()
    for tokens in (p1, p2):
        chunks = stored_chunks(data, tokens)
        assert len(chunks) == 2 and all(c is not None for c in chunks), "every whole chunk was stored"
        for j, chunk in enumerate(chunks):
            assert torch.equal(chunk, kv_of(tokens[j * CHUNK : (j + 1) * CHUNK], j * CHUNK)), (tokens is p1, j)
    assert held_at_end and free_at_end == 0 and not r2_ran_in_stall
    saves = engine.worker.worker.saves
    assert not saves.reading and not saves.revoke and not saves.held  # nothing leaked
    mine = [line for line in records.lines if "xxxxxxxxxx" in line]
    assert len(mine) == 1 and "r1" in mine[0] and "session_id" in mine[0], mine
    assert max(len(line) for line in records.lines) < 600, max(records.lines, key=len)[:300]


def test_bad_params_never_cost_a_request_its_hits(model: str, tmp_path: Path, records: Records) -> None:
    """A stored prefix is offered to a request whatever else its params get wrong: an invalid session
    id, a state that is no JSON object, a hint naming an invalid agent. Each bad part is logged once
    for its request however often vLLM asks (values cut to about 100 characters), the request loads
    the prefix through the scheduler, and the bad parts store nothing (no session, no hold)."""
    data = tmp_path / "data"
    engine = Engine(model, data, num_blocks=12)
    prompt = toks(300, 3)
    cases = {
        "plain": None,
        "bad-id": {"agentstate": {"session_id": "y" * LONG + " id", "state": {"a": 1}}},
        "bad-state": {"agentstate": {"session_id": "ok-session", "state": "z" * LONG}},
        "bad-hint": {"agentstate": {"agent_id": "w" * LONG, "hint": "paused", "expected_s": 5}},
        "bad-hint-value": {"agentstate": {"agent_id": "a1", "hint": ["v" * LONG], "expected_s": 5}},
    }
    try:
        engine.add("seed", prompt)
        engine.run_until(lambda: "seed" in engine.finished and "seed" not in engine.scheduler.requests, "seed")
        connector = engine.scheduler.connector
        for f in list(engine.worker.worker.saves.writes):
            f.result(60)
        assert engine.scheduler.reset_prefix_cache()  # only the connector can supply hits now
        asked = {name: connector.get_num_new_matched_tokens(engine.request(name, prompt, params), 0)
                 for name, params in cases.items()}  # fmt: skip
        assert asked["plain"] == (256, True), asked
        assert all(answer == asked["plain"] for answer in asked.values()), asked
        for name, params in cases.items():  # and through the scheduler: each loads the prefix
            engine.add(f"run-{name}", prompt, params)
            engine.run_until(lambda n=name: f"run-{n}" not in engine.scheduler.requests, f"run-{name}")
            assert engine.scheduler.reset_prefix_cache()
    finally:
        engine.close()
    assert engine.worker.counts["loaded_tokens"] == 256 * len(cases)
    assert engine.worker.counts["load_error_blocks"] == 0
    for name, part, marker in (("bad-id", "session_id", "yyyyyyyyyy"), ("bad-state", "state", "zzzzzzzzzz"),
                               ("bad-hint", "hint", "wwwwwwwwww"), ("bad-hint-value", "hint", "vvvvvvvvvv")):
        lines = [line for line in records.lines if marker in line]
        assert len(lines) == 2, (name, lines)  # the direct ask and the scheduled request: once each
        assert all(f"served without its {part}" in line for line in lines), lines
    assert max(len(line) for line in records.lines) < 600, max(records.lines, key=len)[:300]

    async def sessions() -> list[str]:
        spec = ModelSpec.model_validate_json((data / "spec.json").read_text())
        async with StateStore.open(data, spec, chunk_tokens=CHUNK, read_only=True) as store:
            return [m.session_id async for m in store.sessions()]

    assert asyncio.run(sessions()) == ["ok-session"]  # the bad state dropped, the valid session stored


def test_failed_load_is_never_offered_again(model: str, tmp_path: Path) -> None:
    """Issue 25 item 2's loop, in one engine: a load that fails (here: the store's loop too busy to
    serve it within timeout_s) is recomputed, and the request is never offered that hit again,
    though the prefix is still stored and the store answers again: one load, its blocks recomputed."""
    data = tmp_path / "data"
    engine = Engine(model, data, num_blocks=12, timeout_s=1.0)
    prompt = toks(300, 4)
    try:
        engine.add("seed", prompt)
        engine.run_until(lambda: "seed" not in engine.scheduler.requests, "seed")
        for f in list(engine.worker.worker.saves.writes):
            f.result(60)
        assert engine.scheduler.reset_prefix_cache()
        engine.add("again", prompt)
        out = engine.scheduler.schedule()  # the lookup: a hit, loaded asynchronously
        req = engine.scheduler.requests["again"]
        assert not out.num_scheduled_tokens and req.status.name == "WAITING_FOR_REMOTE_KVS"
        engine.worker.bind_connector_metadata(out.kv_connector_metadata)
        with engine.stall():  # the load cannot run: it times out
            engine.worker.start_load_kv(None)  # type: ignore[arg-type]
            engine.worker.clear_connector_metadata()
            from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

            engine.scheduler.update_from_output(out, ModelRunnerOutput(req_ids=[], req_id_to_index={}))
            engine.run_until(lambda: engine.worker.counts["loads"] == 1, "the load timed out", limit_s=60)
        engine.run_until(lambda: "again" not in engine.scheduler.requests, "the request finished")
    finally:
        engine.close()
    counts = engine.worker.counts
    assert counts["loads"] == 1 and counts["hit_tokens"] == 256 and counts["loaded_tokens"] == 0, counts
    assert counts["load_error_blocks"] == 2, counts
