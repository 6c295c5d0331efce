"""The worker's writes: chunks each step completes, and sessions of finished requests, copied out of the
engine's blocks off the step, plus the bookkeeping that says when those blocks may be reused. (A hybrid
model's chunks and boundary states are copied out on the step, `_save_now`: see `groups.py`.)

After each forward, the full chunks this step completed are handed to the store's loop, which
dedupes them against the index, copies them out of the engine's blocks straight into canonical KV,
and writes them: nothing of it runs on the step. Computed blocks never change, and the blocks stay
the request's while it runs; a finished request's blocks are held (delay-free) until its copies are
done (`released`, then `copied`), and a preempted request's copies still in flight are revoked
(`preempted`: their result is dropped, never stored, as the blocks may be another request's by the
next forward). Beyond `max_pending_saves` chunks in flight, saves are dropped (counted).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from agentstate.adapters.runtime import LoopThread
from agentstate.adapters.vllm.blocks import EngineBlocks
from agentstate.adapters.vllm.config import ConnectorConfig
from agentstate.adapters.vllm.metadata import SaveJob, SessionJob
from agentstate.adapters.vllm.metrics import Counts
from agentstate.errors import ConflictError
from agentstate.layouts import NativeKV
from agentstate.store import StateStore

Future = concurrent.futures.Future


class Saves:
    """The worker's writes in flight, per request, and the copies out of each request's blocks."""

    def __init__(
        self, config: ConnectorConfig, counts: Counts, loop: LoopThread,
        attached: Callable[[], tuple[StateStore, EngineBlocks]],
    ) -> None:  # fmt: skip
        self.config = config
        self.counts = counts
        self.loop = loop
        self._attached = attached  # the open store and the engine's blocks, or BackendError
        self.writes: list[Future[None]] = []  # every save and snapshot in flight: shutdown waits for them
        # per running request: copies out of its blocks not yet done, and the flag that revokes them
        self.reading: dict[str, list[Future[None]]] = {}
        self.revoke: dict[str, threading.Event] = {}
        self.held: dict[str, list[Future[None]]] = {}  # finished: blocks held for these
        # (tenant, session id) -> its snapshot in flight: a lookup of that session waits for it
        self.saving: dict[tuple[str, str], Future[None]] = {}
        # per request, its writes in flight: a paused hint of the request waits for them
        self.by_request: dict[str, list[Future[None]]] = {}
        # chunk key (this rank's) -> the write storing it: a lookup of a prompt whose prefix is being
        # written right now (the agent's next turn, a moment after the last) waits for it, not a miss
        self.writing: dict[str, Future[None]] = {}
        self._pending = 0  # chunks handed to the loop, not yet written
        self._lock = threading.Lock()

    # -- the blocks' life --------------------------------------------------------------------------

    def preempted(self, req_id: str) -> None:
        """The request's blocks are freed this step: copies out of them still in flight are revoked."""
        flag = self.revoke.pop(req_id, None)
        if flag is not None:
            flag.set()
        self.reading.pop(req_id, None)

    def released(self, req_id: str) -> None:
        """The request finished: its blocks are held until the copies out of them are done."""
        self.held[req_id] = self.reading.pop(req_id, [])
        self.revoke.pop(req_id, None)

    def copied(self) -> set[str]:
        """Finished requests whose copies are all done: their blocks go back to vLLM now."""
        done = {r for r, reads in self.held.items() if all(f.done() for f in reads)}
        for req_id in done:
            del self.held[req_id]
        return done

    def writes_of(self, req_id: str) -> list[Future[None]]:
        """The request's writes in flight, forgotten here (what its paused/done hint waits for)."""
        return list(self.by_request.pop(req_id, []))

    def drain(self, timeout_s: float) -> None:
        """Wait for every write in flight, `timeout_s` for all of them; a failed or late one is dropped."""
        deadline = time.monotonic() + timeout_s
        for f in self.writes:
            try:
                f.result(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001, S110 - counted where it failed (or late: dropped)
                pass

    # -- chunks ------------------------------------------------------------------------------------

    def save(self, jobs: list[SaveJob], blocks: EngineBlocks) -> None:
        """Hand this step's completed chunks to the store's loop: deduped, copied out of the blocks
        into canonical KV and written there, off the step. Beyond `max_pending_saves` chunks in
        flight, saves are dropped."""
        ready = _forward_done(blocks)
        for job in jobs:
            if self._pending + len(job.chunks) > self.config.settings.max_pending_saves:
                self.counts.add(saves_dropped=len(job.chunks))  # never stall the step behind a slow store
                continue
            if job.groups is not None:
                write = self._save_now(job, blocks, ready)
            else:
                with self._lock:
                    self._pending += len(job.chunks)
                flag = self.revoke.setdefault(job.req_id, threading.Event())
                read: Future[None] = Future()
                self.reading.setdefault(job.req_id, []).append(read)
                write = asyncio.run_coroutine_threadsafe(self._save(job, flag, read, ready), self.loop.loop)
            self.writes.append(write)
            mine = [f for f in self.by_request.get(job.req_id, []) if not f.done()]
            self.by_request[job.req_id] = [*mine, write]
            live = {k: f for k, f in self.writing.items() if not f.done()}  # replaced whole: the loop reads it
            live.update(dict.fromkeys(self.config.own(job.keys), write))
            self.writing = live

    def prune(self) -> None:
        self.writes = [f for f in self.writes if not f.done()]

    def _save_now(self, job: SaveJob, blocks: EngineBlocks, ready: Any) -> Future[None]:
        """A hybrid model's save: its chunks and state are copied out here, on the step (a sliding
        group's blocks and a Mamba state's block leave the request within a step or two, before a copy
        off the step is sure to have run), and written off it."""
        c, per = self.config.chunk_tokens, self.config.chunk_tokens // self.config.block_size
        try:
            if ready is not None:
                ready.synchronize()
            chunks: dict[int, torch.Tensor | NativeKV] = {}
            todo = self._unknown(job)
            if todo:
                assert job.groups is not None
                ids = [b for j in todo for b in job.block_ids[j * per : (j + 1) * per]]
                groups = [[b for j in todo for b in g[j * per : (j + 1) * per]] for g in job.groups]
                kv = self._copy_out(blocks, ids, len(todo) * c, None, None, groups=groups)
                assert kv is not None
                chunks = {j: kv[:, :, k * c : (k + 1) * c] for k, j in enumerate(todo)}
            state = blocks.state_at(job.state_block) if job.state_block is not None else None
        except Exception as exc:  # noqa: BLE001 - a lost save is a later miss
            self.counts.failed("save", exc)
            done: Future[None] = Future()
            done.set_result(None)
            return done
        with self._lock:
            self._pending += len(job.chunks)
        return asyncio.run_coroutine_threadsafe(self._write(job, chunks, state), self.loop.loop)

    def _unknown(self, job: SaveJob) -> list[int]:
        """The job's chunks the store does not hold yet (asked on the step: a returning prompt's loaded
        chunks are not copied out again); all of them when the store cannot say in time."""
        if not job.chunks:
            return []
        try:
            store, _ = self._attached()
            known = self.loop.run(self._known(store, self.config.own(job.keys)), self.config.settings.lookup_timeout_s)
            return [j for j, held in zip(job.chunks, known) if not held]
        except Exception:  # noqa: BLE001 - copied and deduped on write, as ever
            return list(job.chunks)

    async def _write(
        self, job: SaveJob, chunks: dict[int, torch.Tensor | NativeKV], state: dict[str, torch.Tensor] | None
    ) -> None:
        """Write chunks already copied out of the blocks (and a hybrid model's boundary state)."""
        try:
            store, _ = self._attached()
            await self._put(store, job, chunks, state)
        except Exception as exc:  # noqa: BLE001 - a lost save is a later miss
            self.counts.failed("save", exc)
        finally:
            with self._lock:
                self._pending -= len(job.chunks)

    async def _put(
        self, store: StateStore, job: SaveJob, chunks: dict[int, torch.Tensor | NativeKV],
        state: dict[str, torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        view = store.for_tenant(job.tenant)
        if job.salt and chunks:  # the KV events hash these chunks as vLLM does: salted (learned before they are stored)
            view.chunks.learn(view.prefix_keys(job.tokens)[: max(chunks) + 1], job.tokens, job.salt)
        stored = await view.put_chunks(job.tokens, chunks, model_state=state)
        self.counts.add(stored_tokens=stored, states_saved=int(state is not None))

    def _copy_session(
        self, blocks: EngineBlocks, job: SessionJob, ready: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """A finished request's KV of every token (held blocks: off the step), and a Mamba model's state
        after its last token."""
        kv = self._copy_out(blocks, job.block_ids, len(job.tokens), ready, None, groups=job.groups)
        assert kv is not None
        return kv, blocks.state_at(job.state_block) if job.state_block is not None else None

    async def _known(self, store: StateStore, keys: list[str]) -> list[bool]:
        missing = set(await store.chunks.missing(keys, durable=False)) if keys else set()
        return [i not in missing for i in range(len(keys))]

    def _copy_out(
        self, blocks: EngineBlocks, block_ids: list[int], n: int, ready: Any, flag: threading.Event | None,
        native: bool = False, groups: list[list[int]] | None = None,
    ) -> torch.Tensor | None:  # fmt: skip
        """Canonical KV of the first `n` tokens of these blocks (`native`: the whole blocks as they lie
        in memory, `blocks.native_code`'s payload; `groups`: a hybrid model's block ids per group), or
        None when revoked meanwhile (the copy may have read blocks another request was already writing)."""
        if ready is not None:
            ready.synchronize()
        if flag is not None and flag.is_set():
            return None
        kv = (blocks.gather_native(block_ids) if native
              else blocks.gather(block_ids, n, self.config.spec.empty_kv(n), groups))  # fmt: skip
        if flag is not None and flag.is_set():
            return None
        return kv

    async def _save(self, job: SaveJob, flag: threading.Event, read: Future[None], ready: Any) -> None:
        c, per = self.config.chunk_tokens, self.config.chunk_tokens // self.config.block_size
        try:
            try:
                store, blocks = self._attached()
                present = await self._known(store, self.config.own(job.keys))
                todo = [j for j, known in zip(job.chunks, present) if not known]
                chunks: dict[int, torch.Tensor | NativeKV] = {}
                if todo:
                    ids = [b for j in todo for b in job.block_ids[j * per : (j + 1) * per]]
                    code = blocks.native_code
                    kv = await asyncio.to_thread(self._copy_out, blocks, ids, len(todo) * c, ready, flag, code is not None)
                    if kv is None:
                        self.counts.add(saves_revoked=len(todo))
                        return
                    if code is not None:  # [layers, blocks, ...]: chunk k is blocks k*per .. (k+1)*per
                        shape = self.config.spec.kv_shape(c)
                        chunks = {j: NativeKV(code, kv[:, k * per : (k + 1) * per], shape) for k, j in enumerate(todo)}
                    else:
                        chunks = {j: kv[:, :, k * c : (k + 1) * c] for k, j in enumerate(todo)}
            finally:
                read.set_result(None)  # the blocks are no longer read: they may be freed
            if chunks:
                await self._put(store, job, chunks)
        except Exception as exc:  # noqa: BLE001 - a lost save is a later miss
            self.counts.failed("save", exc)
        finally:
            with self._lock:
                self._pending -= len(job.chunks)

    # -- sessions ----------------------------------------------------------------------------------

    def snapshot(self, job: SessionJob) -> None:
        """Snapshot a finished request's session off the step; its blocks are held until copied out."""
        read: Future[None] = Future()
        self.held.setdefault(job.req_id, []).extend([*self.reading.pop(job.req_id, []), read])
        self.revoke.pop(job.req_id, None)
        try:
            store, blocks = self._attached()
            copy = self._snapshot(store, blocks, job, read, _forward_done(blocks))
            saved = asyncio.run_coroutine_threadsafe(copy, self.loop.loop)
            self.writes.append(saved)
            live = {k: f for k, f in self.saving.items() if not f.done()}  # replaced whole: the loop reads it
            live[(job.tenant, job.session_id)] = saved
            self.saving = live
        except Exception as exc:  # noqa: BLE001 - the blocks must be released either way
            self.counts.failed("snapshot", exc)
            read.set_result(None)

    async def _snapshot(
        self, store: StateStore, blocks: EngineBlocks, job: SessionJob, read: Future[None], ready: Any
    ) -> None:
        try:
            try:
                kv, state = await asyncio.to_thread(self._copy_session, blocks, job, ready)
            finally:
                read.set_result(None)
            view = store.for_tenant(job.tenant)
            try:
                await view.snapshot(job.session_id, job.tokens, kv, job.state, model_state=state)
            except ConflictError:  # another writer of this id committed meanwhile: the newest turn wins
                await view.snapshot(job.session_id, job.tokens, kv, job.state, force=True, model_state=state)
            self.counts.add(sessions_saved=1)
        except Exception as exc:  # noqa: BLE001
            self.counts.failed("snapshot", exc)


def _forward_done(blocks: EngineBlocks) -> Any:
    """What a copy off the step waits for: nothing on CPU (the forward has returned); on CUDA an
    event after this step's kernels."""
    if blocks.is_cuda:
        event = torch.cuda.Event()
        event.record()
        return event
    return None
