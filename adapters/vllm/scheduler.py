"""The connector's scheduler side (vLLM's EngineCore process, on CPU): lookups and plans, no KV.

It computes agentstate's chunk keys over a prompt's token ids (cache_salt, where set, is the tenant
namespace) and asks its engine's worker over the lookup channel how many leading chunks are stored
(`lookup.py`); vLLM is told of whole chunks beyond its own hit, leaving at least one prompt token to
compute. Each step it plans for the worker (`metadata.py`): the loads of requests just allocated,
the full chunks each running request completed (saves), and what finished requests leave behind
(snapshots, hints, blocks to hold until their copies are done). A request's agentstate params are
read once, when it is first seen (`params.py`).

Never answers `request_finished` with delay_free=False while copies of the request's blocks may be
in flight: vLLM would hand the blocks to the next request while the store still reads them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentstate.adapters.runtime import never_raises
from agentstate.adapters.vllm.config import ConnectorConfig, data_dir
from agentstate.adapters.vllm.groups import NULL_BLOCK, state_block
from agentstate.adapters.vllm.lookup import LookupClient, socket_name
from agentstate.adapters.vllm.metadata import AgentStateMetadata, HintJob, LoadJob, SaveJob, SessionJob
from agentstate.adapters.vllm.metrics import AgentStateStats, Counts, log
from agentstate.adapters.vllm.params import RequestHint, RequestParams, clip, clip_message, parse_params

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.request import Request


@dataclass
class _Tracked:
    """Scheduler-side state of one request."""

    request: Any
    tenant: str
    groups: list[list[int]] = field(default_factory=list)  # block ids per KV cache group
    saved: int = 0  # chunks handed to the worker (or known stored)


class SchedulerSide:
    """The scheduler role of `AgentStateConnector` (see the module doc)."""

    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig) -> None:
        self.config = config
        self.counts = Counts()
        self.block_pool: Any = None  # vLLM's own prefix cache (bind_gpu_block_pool), read only
        # A failed load falls back to recompute (vLLM's default is to fail the request).
        vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
        self._clients = [
            LookupClient(
                socket_name(str(data_dir(vllm_config, config.settings, r).resolve()), r, config.engine),
                config.settings.lookup_timeout_s,
            )
            for r in range(config.ranks)
        ]
        self._lookup_logged: set[str] = set()  # kinds of lookup failure logged (once each)
        self._tracked: dict[str, _Tracked] = {}
        self._matched: dict[str, tuple[int, dict[str, Any]]] = {}
        self._loads: list[LoadJob] = []
        self._load_blocks: dict[str, set[int]] = {}  # per request whose load is in flight: its blocks
        self._no_hits: set[str] = set()  # requests whose load failed: never reported as hits again
        self._sessions: list[SessionJob] = []
        self._released: list[str] = []
        self._params: dict[str, RequestParams] = {}  # per request, checked once (logged once if bad)
        self._hinted: set[str] = set()  # requests whose resuming hint went to the worker
        self._hint_jobs: list[HintJob] = []
        groups = config.groups
        self._kv_group = 0 if groups is None else min(groups.attention.values())  # block_ids of jobs: this group's

    def _failed(self, call: str, exc: BaseException) -> None:
        self.counts.failed(call, exc)

    def _tenant(self, request: Request) -> str:
        return self.config.tenant_of(request.cache_salt)

    # -- the lookup channel ------------------------------------------------------------------------

    def _ask(self, request: dict[str, Any]) -> list[dict[str, Any]] | None:
        """This engine's workers' replies, or None (a miss) when one cannot be reached or is not this
        engine's: each kind of failure is logged once, and counted."""
        try:
            replies = [client.ask(request) for client in self._clients]
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            self._lookup_failed(
                "absent", f"this engine's worker serves no lookups ({exc}): its store is not open (the"
                " worker's log says why); every prompt is a miss",
            )  # fmt: skip
            return None
        except OSError as exc:  # TimeoutError and connection errors: the worker is down or slow
            self._lookup_failed(type(exc).__name__, f"{clip_message(exc)} (treated as a miss)")
            return None
        if any(r.get("engine") != self.config.engine for r in replies):  # the name has the token: a stale worker
            self._lookup_failed("foreign", "the lookup channel answered for another engine (treated as a miss)")
            return None
        bad = [r["error"] for r in replies if "error" in r]
        if bad:
            self._lookup_failed("error", f"{clip(str(bad[0]), 300)} (treated as a miss)")
            return None
        return replies

    def _lookup_failed(self, kind: str, message: str) -> None:
        self.counts.add(lookup_errors=1)
        if kind not in self._lookup_logged:
            self._lookup_logged.add(kind)
            log.warning("agentstate lookup failed (logged once, counted as lookup_errors): %s", message)

    def _params_for(self, request: Request) -> RequestParams:
        """The request's agentstate params, checked once when it is first seen; the parts that are
        malformed are dropped and logged once (values cut), so they never fail or cost the request."""
        req_id = request.request_id
        params = self._params.get(req_id)
        if params is not None:
            return params
        try:
            params = parse_params(request.kv_transfer_params)
        except Exception as exc:  # noqa: BLE001 - parse_params never raises; served without params if it did
            params = RequestParams(problems=(("agentstate params", clip_message(exc)),))
        if self.config.groups is not None and not self.config.groups.sessions and params.session_id is not None:
            # a session is every token's KV: a sliding group lets the blocks before its window go while the
            # request runs, so the turn is stored as a prefix (its chunks), not a session
            problem = ("session_id", "InvalidArgumentError: the vLLM connector stores a sliding-window model's turns"
                       " as prefixes, not as named sessions (yet)")  # fmt: skip
            params = RequestParams(None, None, None, (*params.problems, problem))
        for part, problem in params.problems:
            log.warning("agentstate: request %s is served without its %s: %s", clip(req_id), part, problem)
        if any(part == "hint" for part, _ in params.problems):
            self.counts.add(hints_invalid=1)
        self._params[req_id] = params
        return params

    def _hint_for(self, request: Request) -> RequestHint | None:
        return self._params_for(request).hint

    def _send_resuming(self, request: Request) -> None:
        """A resuming hint goes to the worker once, as soon as the request is seen: the worker brings
        the prompt's stored prefix up into host memory on its loop (the reply does not wait for it)."""
        hint = self._hint_for(request)
        if hint is None or hint.arrival is None or request.request_id in self._hinted:
            return
        self._hinted.add(request.request_id)
        tokens = list(request.prompt_token_ids or request.all_token_ids)
        tenant = self._tenant(request)
        self._ask({"op": "hint", "req_id": request.request_id, "tenant": tenant, "name": hint.name,
                   "session": hint.session, "hint": hint.arrival, "expected_s": None,
                   "tokens": tokens, "local": self._local_hit(request)})  # fmt: skip

    def _local_hit(self, request: Request) -> int:
        """Leading prompt tokens vLLM's own prefix cache holds now (0 when it cannot be asked)."""
        pool, hashes = self.block_pool, getattr(request, "block_hashes", None)
        if pool is None or not hashes:
            return 0
        try:
            n = 0
            for block_hash in hashes:
                if not pool.get_cached_block(block_hash, [0]):
                    break
                n += 1
            return n * self.config.block_size
        except Exception:  # noqa: BLE001 - another vLLM's block pool: bring up everything stored
            return 0

    # -- requests arriving -------------------------------------------------------------------------

    @never_raises(lambda *_, **__: None)
    def on_new_request(self, request: Request) -> None:
        """A request was added: a resuming hint starts its prefix's way up now, before it is scheduled."""
        self._send_resuming(request)

    @never_raises(lambda *_, **__: (0, False))
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Whole stored chunks beyond vLLM's own hit (at least one prompt token left to compute);
        a session named in kv_transfer_params adds its tail. Loaded asynchronously."""
        with contextlib.suppress(Exception):  # an engine without on_new_request: the hint goes now
            self._send_resuming(request)
        if request.request_id in self._no_hits:  # its load failed: recomputed, never offered again
            return 0, False
        c = self.config.chunk_tokens
        tokens = list(request.all_token_ids[: request.num_tokens])
        limit = len(tokens) - 1
        tenant = self._tenant(request)
        session = self._params_for(request).session
        if session is not None and any(j.tenant == tenant and j.session_id == session[0] for j in self._sessions):
            # The session's previous turn finished and its snapshot reaches the worker with the next
            # step: an idle engine's next request would be looked up before it and miss the tail.
            # None: vLLM asks again next step (the snapshot on its way, which the lookup waits for).
            return None, False
        keys = self.config.keys(tokens[: limit // c * c], tenant)
        if not keys and session is None:
            return 0, False
        query: dict[str, Any] = {"op": "lookup", "keys": keys, "tenant": tenant}
        if session is not None:
            query.update(session=session[0], tokens=tokens)
        replies = self._ask(query)
        if replies is None:
            return 0, False
        hit = min(int(r.get("chunks", 0)) for r in replies) * c
        plan: dict[str, Any] = {"keys": keys, "chunks": hit // c}
        sess = [r.get("session") for r in replies]
        if session is not None and all(sess) and _agree(sess):
            # every TP rank holds the session alike (its snapshot of the same turn); a tail is each rank's own value
            n, full = sess[0]["tokens"], len(sess[0]["chunk_keys"])
            tails = [s["tail_key"] for s in sess]
            if n > hit and sess[0]["chunk_tokens"] == c and (self.config.groups is None or n <= limit):
                hit = min(n, limit)  # a hybrid session is loaded whole (its state is after its last token) or not at all
                plan = {"keys": sess[0]["chunk_keys"], "chunks": full, "tail_key": tails[0],
                        "tails": tails if len(set(tails)) > 1 else None,
                        "tail_tokens": n - full * c, "tail_stored": sess[0].get("tail_stored"),
                        "state_key": sess[0].get("state_key")}  # fmt: skip
        if hit <= num_computed_tokens:
            return 0, False
        self._matched[request.request_id] = (num_computed_tokens, {**plan, "end": hit})
        return hit - num_computed_tokens, self.config.settings.load_mode == "async"

    @never_raises(lambda *_, **__: None)
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        groups = [list(ids) for ids in blocks.get_block_ids()]
        block_ids = groups[self._kv_group] if groups else []
        tracked = self._tracked.get(req_id)
        if tracked is None:
            tracked = self._tracked[req_id] = _Tracked(request, self._tenant(request))
        if block_ids:
            tracked.groups = groups
        matched = self._matched.pop(req_id, None)
        if num_external_tokens <= 0:
            return
        if matched is None:  # cannot happen; fail the load rather than leave the request waiting
            matched = (0, {"keys": [], "chunks": 0, "end": 0})
        first = matched[0]
        try:
            job = self._plan_load(req_id, matched, num_external_tokens, block_ids, tracked.tenant)
            if self.config.groups is not None:
                self._plan_groups(job, groups)
        except Exception as exc:  # noqa: BLE001 - a load with no chunks fails: the request is recomputed
            self._failed("update_state_after_alloc", exc)
            job = LoadJob(req_id, [], [], block_ids, first, first + num_external_tokens, tracked.tenant)
        self._loads.append(job)  # always: vLLM waits for this request's load to be reported
        bs = self.config.block_size
        self._load_blocks[req_id] = set(block_ids[first // bs : -(-job.end // bs)])
        # `saved` stays: loaded chunks are offered for saving too, and the worker's dedupe skips them
        # unless a load found one corrupt (dropped), so the recomputed chunk is stored again.

    def _plan_load(
        self, req_id: str, matched: tuple[int, dict[str, Any]], count: int, block_ids: list[int], tenant: str
    ) -> LoadJob:
        first, plan = matched
        end = first + count
        c = self.config.chunk_tokens
        c0 = first // c
        n_full = min(plan["chunks"], -(-end // c))
        keys = list(plan["keys"][c0:n_full])
        spans = [(i * c, c) for i in range(c0, n_full)]
        stored = [c] * len(keys)
        tails = None
        if plan.get("tail_key") and end > n_full * c:
            keys.append(plan["tail_key"])
            spans.append((n_full * c, plan["tail_tokens"]))
            stored.append(int(plan.get("tail_stored") or plan["tail_tokens"]))
            tails = plan.get("tails")
        job = LoadJob(req_id, keys, spans, block_ids, first, end, tenant, stored, tails)
        job.state_key = plan.get("state_key")
        return job

    def _plan_groups(self, job: LoadJob, groups: list[list[int]]) -> None:
        """A hybrid model's load: every group's blocks, and where a Mamba model's state after `end`
        goes (the block of its state group ending there; the hit is a chunk boundary)."""
        job.groups = groups
        group = self.config.groups.state_group if self.config.groups is not None else None
        if group is None or not job.keys:
            return
        block = state_block(groups[group], job.end, self.config.block_size)
        if not (job.state_key or job.end % self.config.chunk_tokens == 0) or block is None:
            raise ValueError(f"no state block at token {job.end} of a hybrid model's load")
        job.state_block = block

    # -- each step ---------------------------------------------------------------------------------

    @never_raises(lambda *_, **__: AgentStateMetadata())
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = AgentStateMetadata(loads=self._loads, sessions=self._sessions, released=self._released,
                                  hints=self._hint_jobs,
                                  preempted=sorted(scheduler_output.preempted_req_ids or ()))  # fmt: skip
        self._loads, self._sessions, self._released, self._hint_jobs = [], [], [], []
        try:  # the loads, snapshots and releases above must reach the worker whatever fails here
            self._plan_saves(scheduler_output, meta)
        except Exception as exc:  # noqa: BLE001 - this step's saves are lost (a later miss), nothing else
            self._failed("build_connector_meta", exc)
        for req_id in scheduler_output.finished_req_ids:
            self._tracked.pop(req_id, None)
        return meta

    def _plan_saves(self, scheduler_output: SchedulerOutput, meta: AgentStateMetadata) -> None:
        """The full chunks this step completes, per running request, as save jobs."""
        c = self.config.chunk_tokens
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.groups = [list(ids) for ids in new.block_ids]
                computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids or (new_ids and len(new_ids) != len(tracked.groups)):
                tracked.groups = [list(ids) for ids in new_ids] if new_ids else []
            elif new_ids:
                for ids, more in zip(tracked.groups, new_ids):
                    ids.extend(more)
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, done in computed.items():
            tracked = self._tracked[req_id]
            step_end = done + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            end = step_end // c
            if end <= tracked.saved or not tracked.groups:
                continue
            tokens = list(tracked.request.all_token_ids[: end * c])
            keys = self.config.keys(tokens, tracked.tenant)
            todo = list(range(tracked.saved, end))
            job = SaveJob(req_id, tracked.tenant, tokens, [keys[j] for j in todo], todo,
                          list(tracked.groups[self._kv_group]), getattr(tracked.request, "cache_salt", None))  # fmt: skip
            tracked.saved = end
            if self.config.groups is not None:
                self._hybrid_save(job, tracked.groups, done, step_end)
            if job.chunks or job.state_block is not None:
                meta.saves.append(job)

    def _hybrid_save(self, job: SaveJob, groups: list[list[int]], done: int, step_end: int) -> None:
        """A hybrid model's save: only chunks every attention group still holds whole (a sliding group
        lets blocks before its window go at the next step: those of earlier steps may be gone), and a
        Mamba model's state where this step ends on the last chunk's end (vLLM's align mode keeps the
        state there, in the block ending there, only where a step ended there)."""
        hybrid = self.config.groups
        assert hybrid is not None
        bs, c = self.config.block_size, self.config.chunk_tokens
        per = c // bs
        job.groups = [list(ids) for ids in groups]
        keep = []
        for k, j in enumerate(job.chunks):
            whole = True
            for g, kind in enumerate(hybrid.kinds):
                if kind == "mamba":
                    continue
                ids = groups[g][j * per : (j + 1) * per]
                window = hybrid.windows[g]
                gone = max(0, done - window + 1) // bs if window is not None else 0  # blocks vLLM may have freed
                whole = whole and len(ids) == per and NULL_BLOCK not in ids and j * per >= gone
            if whole:
                keep.append(k)
            else:
                self.counts.add(saves_skipped_window=1)
        job.keys, job.chunks = [job.keys[k] for k in keep], [job.chunks[k] for k in keep]
        group = hybrid.state_group
        if group is not None and step_end % c == 0:  # the step ends on the end of its last chunk
            job.state_block = state_block(groups[group], step_end, bs)

    # -- requests finishing ------------------------------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The blocks are held while the worker still copies out of them: chunks handed over for
        saving, and a session named in kv_transfer_params (snapshotted now). The worker reports
        the request in `get_finished` once its copies are done. A paused or done hint goes to the
        worker with them, applied once they are written.

        Never answers False while copies of the request's blocks may be in flight, whatever fails
        here: vLLM would hand the blocks to the next request while the store still reads them, and
        the chunks stored under this request's keys would hold that request's KV."""
        req_id = request.request_id
        tracked = self._tracked.pop(req_id, None)
        copying = tracked is not None and tracked.saved > 0
        try:
            return self._finished(request, block_ids, copying), None
        except Exception as exc:  # noqa: BLE001 - nothing may escape into vLLM's threads
            self._failed("request_finished", exc)
            held = copying or any(job.req_id == req_id for job in self._sessions)
            if held and req_id not in self._released:
                self._released.append(req_id)  # the worker reports it once its copies are done
            return held, None
        finally:
            for table in (self._matched, self._params, self._load_blocks):
                table.pop(req_id, None)
            self._hinted.discard(req_id)
            self._no_hits.discard(req_id)

    def _finished(self, request: Request, block_ids: tuple[list[int], ...], copying: bool) -> bool:
        """request_finished's work: whether the blocks are held. Jobs are queued last, once nothing
        else can fail."""
        req_id = request.request_id
        params = self._params_for(request)
        hint = params.hint
        n = min(int(request.num_computed_tokens), len(request.all_token_ids))
        tenant = self._tenant(request)
        hint_job = None
        if hint is not None and hint.finish is not None:
            hint_job = HintJob(req_id, tenant, hint.name, hint.session, hint.finish, hint.expected_s,
                               list(request.all_token_ids[:n]))  # fmt: skip
        session = params.session
        session_job = None
        kv_ids = block_ids[self._kv_group] if len(block_ids) > self._kv_group else []
        if session is not None and n > 0 and kv_ids:
            tokens = list(request.all_token_ids[:n])
            session_job = SessionJob(req_id, tenant, session[0], session[1], tokens, list(kv_ids))
            if self.config.groups is not None:  # every group's blocks; a Mamba model's state after token n
                session_job.groups = [list(ids) for ids in block_ids]
                group = self.config.groups.state_group
                if group is not None:
                    session_job.state_block = state_block(block_ids[group], n, self.config.block_size)
                    if session_job.state_block is None:
                        raise ValueError(f"no state block at token {n} of a finished hybrid request")
        if hint_job is not None:
            self._hint_jobs.append(hint_job)
        if session_job is not None:
            self._sessions.append(session_job)  # the worker holds the blocks until the snapshot copied them
            return True
        if copying or hint_job is not None:
            self._released.append(req_id)  # a hint alone: reported at once, the engine steps to deliver it
            return True
        return False

    @never_raises(lambda *_, **__: None)
    def update_connector_output(self, connector_output: Any) -> None:
        """Loads that failed (their blocks in `invalid_block_ids`, or the request in `failed_recving`):
        the request is recomputed, and never offered a hit again. A worker that cannot load would
        otherwise see it again at once, and the engine would reschedule it forever."""
        if not self._load_blocks:
            return
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        received = set(getattr(connector_output, "finished_recving", None) or ())
        for req_id, blocks in list(self._load_blocks.items()):
            if req_id in failed or not invalid.isdisjoint(blocks):
                self._no_hits.add(req_id)
                del self._load_blocks[req_id]
            elif req_id in received:
                del self._load_blocks[req_id]

    def get_kv_connector_stats(self) -> AgentStateStats | None:
        """This interval's counts of the scheduler (hints_invalid); vLLM sums them with the workers'."""
        return self.counts.take()


def _agree(sessions: list[dict[str, Any]]) -> bool:
    """Every TP rank's lookup found the same session: the same tokens, chunks (named as rank 0's) and
    tail length. A rank whose snapshot of the last turn failed holds an older one: no session hit."""
    return len({(s["tokens"], tuple(s["chunk_keys"]), s.get("tail_stored"), s["chunk_tokens"]) for s in sessions}) == 1
