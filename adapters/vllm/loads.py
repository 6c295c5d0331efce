"""The worker's loads: stored chunks read straight into a request's blocks while the request waits.

A load runs on the store's loop between steps (vLLM keeps its request in WAITING_FOR_REMOTE_KVS)
and lands through a `BlocksTarget` over the engine's registered caches; other requests' forwards go
on. Whatever part of it is missing, corrupt or late is reported through
`get_block_ids_with_load_errors` and vLLM recomputes from there (the connector sets
`kv_load_failure_policy` to "recompute"). A load past `timeout_s` is cancelled and its target
closed first, so nothing writes into blocks vLLM has taken back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import Counter
from collections.abc import Callable

import torch

from agentstate.adapters.runtime import LoopThread
from agentstate.adapters.vllm.blocks import BlocksTarget, EngineBlocks
from agentstate.adapters.vllm.config import ConnectorConfig
from agentstate.adapters.vllm.hints import Hints
from agentstate.adapters.vllm.metadata import LoadJob
from agentstate.adapters.vllm.metrics import BYTES_READ, Counts
from agentstate import model_state
from agentstate.keys import boundary_key
from agentstate.store import StateStore

Future = concurrent.futures.Future


class Loads:
    """Loads in flight, per request, and the blocks whose load failed (for vLLM to recompute)."""

    def __init__(
        self, config: ConnectorConfig, counts: Counts, loop: LoopThread,
        attached: Callable[[], tuple[StateStore, EngineBlocks]], hints: Hints,
    ) -> None:  # fmt: skip
        self.config = config
        self.counts = counts
        self.loop = loop
        self._attached = attached  # the open store and the engine's blocks, or BackendError
        self.hints = hints
        self._loading: dict[str, tuple[Future[set[int]], BlocksTarget, LoadJob, float]] = {}
        self._errors: set[int] = set()
        self._failed: set[str] = set()  # a hybrid model's requests whose load failed (recomputed whole)

    def start(self, job: LoadJob) -> None:
        if job.req_id in self._loading:
            return
        try:
            _, blocks = self._attached()
            span_end = max([job.end, *(start + n for start, n in job.spans)])
            target = blocks.target(job.block_ids, job.first, span_end, job.end, job.groups)
            future = asyncio.run_coroutine_threadsafe(self._load(job, target), self.loop.loop)
        except Exception as exc:  # noqa: BLE001 - the load fails, the blocks are recomputed
            self.counts.failed("load", exc)
            done: Future[set[int]] = Future()
            done.set_result(set())
            target = BlocksTarget([(torch.empty(0), torch.empty(0))], [], 1, 0, 0)
            future = done
        self._loading[job.req_id] = (future, target, job, time.monotonic())
        self.counts.add(hit_tokens=job.end - job.first)

    def wait(self, job: LoadJob) -> None:
        """Sync mode: this step's forward reads the loaded blocks, so the load is finished here."""
        entry = self._loading.get(job.req_id)
        if entry is not None:
            concurrent.futures.wait([entry[0]], timeout=self.config.settings.timeout_s)
            self._finish(job.req_id, timed_out=not entry[0].done())

    async def _load(self, job: LoadJob, target: BlocksTarget) -> set[int]:
        """Read the job's chunks straight into its blocks; the span starts written in full. A resuming
        hint of the request still bringing them up into host memory is waited for first (at most
        half of timeout_s): the read then finds them there instead of reading the slow tier twice."""
        store, _ = self._attached()
        t0 = time.perf_counter()
        warming = self.hints.arriving(job.req_id)
        if warming is not None and not warming.done():
            await asyncio.wait({warming}, timeout=self.config.settings.timeout_s / 2)
        if not job.keys:
            return set()
        usage: Counter[str] = Counter()
        t1 = time.perf_counter()
        keys = self.config.own(job.keys)
        if job.tails:  # a session's tail: this rank's own value
            keys[-1] = self.config.own([job.tails[self.config.rank]])[0]
        with store.chunks.pinned(keys):
            await store.chunks.discover(keys)
            await store.chunks.read(keys, job.spans, target, usage=usage, stored=job.stored)
        if job.state_block is not None:
            await self._state(store, job, keys[-1], target)
        done = set(target.done)
        read = {k: v for k, v in usage.items() if k.startswith(BYTES_READ) and v}
        self.counts.add(**read, load_wait_ms=round(1000 * (t1 - t0)),
                        load_read_ms=round(1000 * (time.perf_counter() - t1)))  # fmt: skip
        view = store.for_tenant(job.tenant) if job.tenant else store
        view.usage_log.add(view.tenant, None, {"loads": 1, "tokens_read": _landed(job, done) - job.first, **read})
        return done

    async def _state(self, store: StateStore, job: LoadJob, last: str, target: BlocksTarget) -> None:
        """A Mamba model's load: its state after `job.end` tokens (a session's, or the boundary's after
        the last chunk) into the state block, unless the load timed out meanwhile (the target is closed)."""
        boundary, block = job.state_key or boundary_key(last), job.state_block
        assert block is not None
        with store.chunks.pinned([boundary]):
            state = await model_state.read(store.chunks, self.config.spec, boundary, job.end)
        if state is not None:
            _, blocks = self._attached()
            target.state_placed = target.run_guarded(lambda: blocks.put_state(block, state))
            self.counts.add(states_loaded=int(target.state_placed))

    def finished(self) -> set[str]:
        """Requests whose load is over (done, or cancelled past timeout_s): vLLM may schedule them now."""
        recving = set()
        now = time.monotonic()
        for req_id, (future, _, _, started) in list(self._loading.items()):
            late = now - started > self.config.settings.timeout_s
            if future.done() or late:
                self._finish(req_id, timed_out=not future.done())  # cancels it when late
                recving.add(req_id)
        return recving

    def _finish(self, req_id: str, timed_out: bool) -> None:
        future, target, job, started = self._loading.pop(req_id)
        if timed_out:
            future.cancel()
        written = target.close()
        if not timed_out and future.done() and not future.cancelled() and future.exception() is not None:
            self.counts.failed("load", future.exception())  # type: ignore[arg-type]
        good = _landed(job, written)
        if job.state_block is not None and not target.state_placed:
            good = job.first  # the KV without the state it continues from is no use: recomputed whole
        self.counts.add(loads=1, load_ms=round(1000 * (time.monotonic() - started)))
        if good < job.end and job.groups is not None:  # vLLM takes a hybrid model's failure per request
            self._failed.add(req_id)
            good = job.first
        elif good < job.end:
            bs = self.config.block_size
            bad = {job.block_ids[t // bs] for t in range(good, job.end) if t // bs < len(job.block_ids)}
            self._errors |= bad
            self.counts.add(load_error_blocks=len(bad))
        self.counts.add(loaded_tokens=good - job.first)

    def failed_requests(self) -> set[str]:
        """A hybrid model's requests whose load failed since the last call (reported with the loads
        finished, `get_transfer_results`): vLLM recomputes them from their first token."""
        failed, self._failed = self._failed, set()
        return failed

    def errors(self) -> set[int]:
        """Blocks whose load failed since the last call: vLLM recomputes from the first of them."""
        errors, self._errors = self._errors, set()
        return errors


def _landed(job: LoadJob, written: set[int]) -> int:
    """Where the job's load ends: spans are in token order, and the first gap ends it."""
    good = job.first
    for start, n in job.spans:
        if start not in written:
            break
        good = start + n
    return min(max(good, job.first), job.end)
