"""The worker's agent hints (see `agentstate.hints`): where a request's stored prefix waits, never what is stored.

`resuming` applies when the request arrives (the scheduler sends it over the lookup channel): the
prompt's stored prefix starts its way up from LMDB/Redis into host memory on the store's loop,
and the request's load waits for that (`arriving`). `paused` and `done` apply when the request
finishes, once what the connector stores for it (its saves, its session's snapshot) is written.
A hint never fails or changes its request: one the store cannot apply is logged and counted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from agentstate.adapters.runtime import LoopThread
from agentstate.adapters.vllm.config import ConnectorConfig
from agentstate.adapters.vllm.metadata import HintJob
from agentstate.adapters.vllm.metrics import Counts, log
from agentstate.adapters.vllm.params import clip, clip_message
from agentstate.adapters.vllm.saves import Saves
from agentstate.store import StateStore

Future = concurrent.futures.Future


class Hints:
    """Agent hints applied on the store's loop, after the writes they are about."""

    def __init__(
        self, config: ConnectorConfig, counts: Counts, loop: LoopThread, store: Callable[[], StateStore], saves: Saves
    ) -> None:
        self.config = config
        self.counts = counts
        self.loop = loop
        self._store = store  # the open store, or BackendError
        self.saves = saves
        # request id -> its resuming hint in flight (on the loop): the request's load waits for it
        self.warming: dict[str, asyncio.Future[None]] = {}

    def arrived(self, request: dict[str, Any]) -> dict[str, Any]:
        """A resuming hint of a request that just arrived (on the loop): started now, not awaited."""
        tokens = [int(t) for t in request.get("tokens", [])]
        job = HintJob(str(request["req_id"]), str(request["tenant"]), str(request["name"]), bool(request["session"]),
                      request["hint"], request.get("expected_s"), tokens, int(request.get("local", 0)))  # fmt: skip
        after: list[Future[None]] = []
        saving = self.saves.saving.get((job.tenant, job.name)) if job.session else None
        if saving is not None:  # the session's previous turn is still being written: hint what it stores
            after.append(saving)
        self.warming = {k: f for k, f in self.warming.items() if not f.done()}
        self.warming[job.req_id] = asyncio.ensure_future(self._apply(job, after, self.config.settings.lookup_timeout_s / 2))
        return {"hint": "started"}

    def arriving(self, req_id: str) -> asyncio.Future[None] | None:
        """The request's resuming hint still in flight, if any (its load waits for it), forgotten here."""
        return self.warming.pop(req_id, None)

    def finished(self, job: HintJob) -> None:
        """A finished request's paused/done hint, applied on the loop once its writes are done."""
        after = self.saves.writes_of(job.req_id)
        saving = self.saves.saving.get((job.tenant, job.name)) if job.session else None
        if saving is not None:
            after.append(saving)
        try:
            self._store()
            self.saves.writes.append(asyncio.run_coroutine_threadsafe(self._apply(job, after), self.loop.loop))
        except Exception as exc:  # noqa: BLE001 - a hint is advice: the request is unaffected
            self._failed(job, exc)

    async def _apply(self, job: HintJob, after: list[Future[None]], wait_s: float | None = None) -> None:
        t0 = time.perf_counter()
        try:
            if after:  # never cancels them (asyncio.wait): they are the request's own writes
                timeout = wait_s or self.config.settings.timeout_s
                await asyncio.wait([asyncio.wrap_future(f) for f in after], timeout=timeout)
            view = self._store().for_tenant(job.tenant)
            if job.hint == "resuming" and not job.session and job.local >= self.config.chunk_tokens:
                await self._warm_past(view, job)
                return
            if job.session:
                result = await view.hint(job.name, job.hint, job.expected_s)
            else:
                result = await view.hint_tokens(job.name, job.tokens, job.hint, job.expected_s)
            self.counts.add(hints=1, hint_moved_bytes=result.moved_bytes)
            log.debug("agentstate hint %s %s: %d chunks, %d in memory, %d bytes brought up", job.hint, job.name,
                      result.chunks, result.in_memory, result.moved_bytes)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a hint is advice: the request is unaffected
            self._failed(job, exc)
        finally:
            self.counts.add(hint_ms=round(1000 * (time.perf_counter() - t0)))

    async def _warm_past(self, view: StateStore, job: HintJob) -> None:
        """Resuming, when vLLM's own prefix cache holds the prompt's first `job.local` tokens: bring up
        only the stored chunks past them (what the load will read). `hint_tokens` would bring up the
        whole prefix, evicting for chunks the load never reads; the request's load follows at once,
        so no hold is placed (the hold of its paused hint, if any, lasts until its end)."""
        c = self.config.chunk_tokens
        keys = self.config.keys(job.tokens, job.tenant)
        stored = await view.lookup_keys(keys)
        first = job.local // c
        if stored <= first:
            self.counts.add(hints_skipped=1)  # vLLM's own cache holds all of it: nothing to bring up
            return
        todo = list(keys[first:stored])
        with view.chunks.pinned(todo):
            await view.chunks.discover(todo)
            _, moved_bytes = await view.chunks.warm(todo, [c] * len(todo))
        view.usage_log.add(view.tenant, None, {"hints": 1})
        self.counts.add(hints=1, hint_moved_bytes=moved_bytes)

    def _failed(self, job: HintJob, exc: BaseException) -> None:
        self.counts.add(hint_errors=1)
        log.warning("agentstate %s hint for %s (request %s) not applied, the request is unaffected: %s",
                    job.hint, clip(job.name), clip(job.req_id), clip_message(exc))  # fmt: skip
