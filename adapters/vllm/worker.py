"""The connector's worker side (the process that owns the KV blocks): the store, lookups, and each step's copies.

The worker opens the store and owns it: a data directory has one writer. It binds the lookup
channel only once the store is open (so holds the directory's lock), named after this engine, and
stamps every reply with the engine's token: a scheduler only ever counts hits its own worker can
load. A worker that cannot open the store (another process holds the directory: an engine left
running after its API server was killed) runs without it, every prompt a miss, and logs one line
naming the holder's PID. The copies themselves are `loads.py` and `saves.py`; agent hints `hints.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentstate.adapters.runtime import LoopThread, never_raises
from agentstate.adapters.vllm.blocks import EngineBlocks, layout_for
from agentstate.adapters.vllm.config import ConnectorConfig, data_dir
from agentstate.adapters.vllm.groups import KVGroups
from agentstate.adapters.vllm.hints import Hints
from agentstate.adapters.vllm.loads import Loads
from agentstate.adapters.vllm.lookup import LookupServer, socket_name
from agentstate.adapters.vllm.metadata import AgentStateMetadata
from agentstate.adapters.vllm.metrics import AgentStateStats, Counts, log
from agentstate.adapters.vllm.params import clip, clip_message
from agentstate.adapters.vllm.saves import Saves
from agentstate.adapters.vllm.service import EmbeddedService
from agentstate.config import StoreConfig
from agentstate.errors import AgentStateError, BackendError, DataDirLockedError, InvalidArgumentError
from agentstate.sessions import leading
from agentstate.spec import DTYPES, ModelSpec
from agentstate.store import StateStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class WorkerSide:
    """The worker role of `AgentStateConnector` (see the module doc)."""

    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.counts = Counts()
        pc = vllm_config.parallel_config
        self.rank = pc.rank if config.ranks > 1 else 0
        self.path = data_dir(vllm_config, config.settings, self.rank)
        self.store: StateStore | None = None
        self.blocks: EngineBlocks | None = None
        self._server: LookupServer | None = None
        self._api: EmbeddedService | None = None
        self.loop = LoopThread("agentstate-vllm")
        self.saves = Saves(config, self.counts, self.loop, self.attached)
        self.hints = Hints(config, self.counts, self.loop, self.ready, self.saves)
        self.loads = Loads(config, self.counts, self.loop, self.attached, self.hints)

    def _failed(self, call: str, exc: BaseException) -> None:
        self.counts.failed(call, exc)

    def attached(self) -> tuple[StateStore, EngineBlocks]:
        """The open store and the engine's blocks; BackendError when either is missing."""
        if self.store is None or self.blocks is None:
            raise BackendError("the agentstate store is not open (unsupported layout, or closed)")
        return self.store, self.blocks

    def ready(self) -> StateStore:
        return self.attached()[0]

    # -- startup -----------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Choose the block layout from the engine's attention backend, open the store, serve lookups.

        An unsupported layout leaves the connector off (logged): no hits, nothing stored."""
        try:
            self.blocks = self._blocks(kv_caches)
            self.store = self.loop.run(self._open(), max(self.config.settings.timeout_s, 600.0))
        except Exception as exc:  # noqa: BLE001 - the engine runs on without the store
            self.counts.add(errors=1)
            # One line, once: its scheduler finds no lookup channel of this engine and answers misses.
            # A directory held by another process (an engine left running) names that process.
            if isinstance(exc, DataDirLockedError):
                why = f"{clip(str(exc), 500)} [an engine left running? stop it, or give this one another path]"
            else:
                why = clip_message(exc, 500)
            log.warning("agentstate: this engine runs without its store (no hits, nothing stored): %s", why)
            self.blocks = None

    def _blocks(self, kv_caches: dict[str, torch.Tensor]) -> EngineBlocks:
        from vllm.model_executor.layers.attention import Attention  # noqa: F401 - vLLM present here

        spec, bs, hybrid = self.config.spec, self.config.block_size, self.config.groups
        layers = self.vllm_config.compilation_config.static_forward_context
        names = list(kv_caches) if hybrid is None else [n for n in kv_caches if n in hybrid.attention]
        if len(names) != spec.num_layers:
            raise InvalidArgumentError(f"{len(names)} KV caches for {spec.num_layers} layers")
        first = layers.get(names[0])
        backend = first.attn_backend.get_name() if first is not None else "?"
        if backend == "CPU_ATTN":
            variant = getattr(first, "isa", None) or _cpu_isa(self.vllm_config, bs, spec)
        else:
            variant = _cuda_layout()
        layout = layout_for(backend, variant, block_size=bs, heads=spec.num_kv_heads, dim=spec.head_dim)
        for name in names:
            if kv_caches[name].dtype != spec.torch_dtype:
                raise InvalidArgumentError(f"KV cache {name} is {kv_caches[name].dtype}, the spec {spec.dtype}")
        log.info("agentstate: %s layout %s (%s %s) at %s", spec.model_id, layout.name, backend, variant, self.path)
        native = [kv_caches[n] for n in names] if self.config.settings.native_layout else None
        planes = [layout.planes(kv_caches[n]) for n in names]
        if hybrid is None:
            return EngineBlocks(layout, planes, native)
        states = _states(layers, hybrid, spec) if hybrid.mamba else None
        return EngineBlocks(layout, planes, native, [hybrid.attention[n] for n in names], states)

    async def _open(self) -> StateStore:
        config = StoreConfig(**{**self.config.overrides, "path": self.path})
        # the open records spec and config (agentstate.datadir): the admin commands open what the engine wrote
        store = await StateStore.open(config, self.config.spec, writer="agentstate.adapters.vllm")
        try:
            name = socket_name(str(Path(self.path).resolve()), self.rank, self.config.engine)
            self._server = LookupServer(name, self._answer, stamp={"engine": self.config.engine})
            await self._server.start()
        except BaseException:
            await store.close()
            raise
        if self.config.settings.serve_port is not None and self.rank == 0:
            try:
                self._api = await EmbeddedService.start(store, self.config.settings)
            except Exception as exc:  # noqa: BLE001 - the engine serves on without the session API
                self.counts.add(errors=1)
                log.warning("agentstate: the session API is off (the engine serves on): %s", clip_message(exc, 500))
        return store

    # -- the lookup channel (on the loop) ----------------------------------------------------------

    async def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """The scheduler's lookup: leading stored chunks, and a named session's manifest if it fits.
        A hint (`op` "hint") is started on this loop and answered at once."""
        store = self.ready()
        if request.get("op") == "hint":
            return self.hints.arrived(request)
        keys = self.config.own([str(k) for k in request.get("keys", [])])
        await self._written(keys)
        reply: dict[str, Any] = {"chunks": await store.lookup_keys(keys) if keys else 0}
        sid = request.get("session")
        if sid:
            reply["session"] = await self._session_hit(store.for_tenant(request["tenant"]), sid, request["tokens"])
        return reply

    async def _written(self, keys: list[str]) -> None:
        """Wait (up to half the scheduler's lookup timeout) for writes in flight of these chunks: a
        prompt whose prefix a request finished a moment ago then finds it stored."""
        writing = self.saves.writing
        pending = {id(f): f for f in (writing.get(k) for k in keys) if f is not None and not f.done()}
        if pending:
            with contextlib.suppress(Exception):  # a failed or slow write: answer with what is stored
                wait_s = self.config.settings.lookup_timeout_s / 2
                await asyncio.wait([asyncio.wrap_future(f) for f in pending.values()], timeout=wait_s)

    async def _session_hit(self, view: StateStore, session_id: str, tokens: list[int]) -> dict[str, Any] | None:
        """What of the session covers a prefix of `tokens`: all of it, or, when the prompt leaves it
        part way (a chat template that re-tokenizes the reply differently, an edited turn), its
        first tokens up to where they differ: KV of a token depends on the tokens before it only,
        so those are the prompt's own, read from the session's chunks (the last one in part). A
        snapshot of this session still being written (the previous turn, finished a moment ago) is
        waited for, up to half the scheduler's lookup timeout: the next turn then finds all of it."""
        saving = self.saves.saving.get((view.tenant, session_id))
        if saving is not None and not saving.done():
            with contextlib.suppress(Exception):  # a failed or slow save: answer with what is stored
                wait_s = self.config.settings.lookup_timeout_s / 2
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(saving)), wait_s)
        try:
            manifest = await view.session(session_id)
        except AgentStateError:
            return None
        n = leading([a == b for a, b in zip(manifest.tokens, tokens)])  # the tokens both start with
        c = manifest.chunk_tokens
        if n == 0:
            return None
        if manifest.state_key is not None and not (n == manifest.num_tokens < len(tokens)):
            return None  # a hybrid session's state is after its last token: whole, before a token to compute, or no hit
        full = list(manifest.chunk_keys[: n // c])
        if n % c == 0:
            part, held = None, 0
        elif n // c < len(manifest.chunk_keys):
            part, held = manifest.chunk_keys[n // c], c  # the prompt leaves the session inside a chunk
        else:
            part, held = manifest.tail_key, manifest.tail_tokens
        state = [manifest.state_key] if manifest.state_key else []
        if not all(await view.chunks.present([*full, *([part] if part else []), *state])):
            return None
        full, part = self.config.planned_form(full), part and self.config.planned_form([part])[0]
        return {"tokens": n, "chunk_keys": full, "tail_key": part, "tail_stored": held, "chunk_tokens": c,
                "state_key": manifest.state_key}  # fmt: skip

    # -- each step ---------------------------------------------------------------------------------

    @never_raises(lambda *_, **__: None)
    def start_load_kv(self, meta: AgentStateMetadata) -> None:
        """Start this step's loads on the store's loop (they complete between steps), and the
        snapshots of finished session requests (their blocks are held until reported)."""
        for req_id in meta.preempted:  # before this step's forward, which may reuse their blocks
            self.saves.preempted(req_id)
        for req_id in meta.released:
            self.saves.released(req_id)
        for job in meta.loads:
            self.loads.start(job)
        for sjob in meta.sessions:
            self.saves.snapshot(sjob)
        for hjob in meta.hints:
            self.hints.finished(hjob)
        for req_id in [*meta.released, *(s.req_id for s in meta.sessions)]:
            self.saves.writes_of(req_id)
        if self.config.settings.load_mode == "sync":  # this step's forward reads the loaded blocks: wait here
            for job in meta.loads:
                self.loads.wait(job)

    @never_raises(lambda *_, **__: None)
    def wait_for_save(self, meta: AgentStateMetadata | None) -> None:
        """Hand this step's completed chunks to the store's loop (`Saves.save`): nothing of it runs on the step."""
        self.saves.prune()
        if meta is None or self.store is None or self.blocks is None:
            return
        self.saves.save(meta.saves, self.blocks)

    @never_raises(lambda *_, **__: (None, None))
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose held blocks may be freed, requests whose load is over)."""
        recving = self.loads.finished()
        sending = self.saves.copied()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.loads.errors()

    def get_kv_connector_stats(self) -> AgentStateStats | None:
        """This interval's counts of the worker; vLLM sums them over workers and the scheduler."""
        return self.counts.take()

    # -- shutdown ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Finish writes and snapshots in flight, close the store, stop the loop. Never raises."""
        if self.loop.closed:
            return
        try:
            self.saves.drain(self.config.settings.timeout_s)  # one bound for all of them
            if self._api is not None:
                self.loop.run(self._api.stop(10.0), 15.0)
            if self._server is not None:
                self.loop.run(self._server.stop(), self.config.settings.timeout_s)
            if self.store is not None:
                self.loop.run(self.store.close(), max(self.config.settings.timeout_s, 60.0))
        except Exception as exc:  # noqa: BLE001
            self._failed("shutdown", exc)
        finally:
            self.store = None
            self.loop.stop()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001, S110 - a half-built worker has nothing to shut down
            pass


def _states(layers: dict[str, Any], hybrid: KVGroups, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The state layout's tensors by name: each Mamba layer's state tensors as vLLM bound them to the
    layer (`[blocks, ...]`, views of the engine's KV memory), checked against the layout."""
    assert spec.state is not None
    wanted = iter(spec.state.tensors)
    out: dict[str, torch.Tensor] = {}
    for name in hybrid.mamba:
        bound = getattr(layers.get(name), "kv_cache", None)
        if isinstance(bound, (list, tuple)) and bound and isinstance(bound[0], (list, tuple)):
            bound = bound[0]  # one per virtual engine
        if not isinstance(bound, (list, tuple)):
            raise InvalidArgumentError(f"Mamba layer {name} has no state tensors bound")
        for t in bound:
            want = next(wanted, None)
            if want is None or tuple(t.shape[1:]) != want.shape or t.dtype != DTYPES[want.dtype]:
                raise InvalidArgumentError(f"Mamba layer {name}: a state tensor {tuple(t.shape)} {t.dtype} is not {want}")
            out[want.name] = t
    if len(out) != len(spec.state.tensors):
        raise InvalidArgumentError(f"{len(out)} Mamba state tensors bound for a layout of {len(spec.state.tensors)}")
    return out


def _cpu_isa(vllm_config: Any, block_size: int, spec: ModelSpec) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(spec.torch_dtype, block_size, spec.head_dim, vllm_config.cache_config.cache_dtype))


def _cuda_layout() -> str:
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        return str(get_kv_cache_layout())
    except Exception:  # noqa: BLE001 - older/newer vLLM: NHD is the flash-attention default
        return "NHD"
