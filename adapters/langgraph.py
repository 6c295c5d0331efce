"""LangGraph: a checkpointer whose threads are agentstate sessions, and hints from tool calls.

`AgentStateSaver` is a `BaseCheckpointSaver` (langgraph-checkpoint 4.x): a thread's checkpoints,
channel values and pending writes are records (`agentstate.records`) of the session its
`thread_id` names (`session_for`), the same session the engine stores the thread's KV under when
its model calls go through `agentstate.adapters.openai_channel`. So one id names both, and they
live and die together: durable, per tenant, with the session's TTL, exported and imported with
it; `delete_thread` deletes the session (KV included), `copy_thread` forks it.

Layout of a thread's records (components percent-encoded, or hashed past 80 characters):

- `lg/c/<ns>/<checkpoint id>`: the checkpoint without its channel values, its metadata and parent
  (JSON; the serde's typed bytes in base64);
- `lg/b/<ns>/<channel>/<version>`: one channel value, written once per new version (`new_versions`),
  so a long thread stores each value once, not once per checkpoint;
- `lg/w/<ns>/<checkpoint id>/<task id>/<idx>`: a pending write. A regular write (idx >= 0) is kept
  as first written; the special channels (error, interrupt, ...) are replaced.

A `put` writes its checkpoint and blobs in one records call (all or none). Reads are checked
(each record's checksum) before the serde sees them; the serde is LangGraph's
(`JsonPlusSerializer`, pickle off). Its msgpack decoding imports the classes named in what it
reads: set `LANGGRAPH_STRICT_MSGPACK=true` to allow only LangGraph's safe types.

`AgentStateHints` is a LangChain callback handler: a tool call that starts sends `paused` with
the tool's `expected_s` (its metadata) or a running estimate per tool; its end sends `resuming`
(the next model call finds the thread in host memory); the end of the graph's run sends `done`.

Limits: `list(None)` (every thread) and `delete_for_runs` are refused: a thread is named by its
config, and nothing lists every thread's runs. A thread keeps its full history (as LangGraph's own
savers do) until `prune`, `delete_thread` or the session's TTL.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any
from urllib.parse import quote, unquote
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_metadata,
    writes_sort_key,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from agentstate.adapters.agents import Bridge, Hinter, SessionBackend, ToolClock
from agentstate.adapters.openai_channel import mark_resuming, session_for
from agentstate.errors import CorruptDataError, InvalidArgumentError, SessionNotFoundError

__all__ = ["AgentStateHints", "AgentStateSaver", "session_for"]

PREFIX = "lg/"


def _part(text: str) -> str:
    """One name component: percent-encoded (no '/', no space), or a hash when that is long."""
    quoted = quote(text, safe="")
    return quoted if len(quoted) <= 80 else "~" + hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _typed(pair: tuple[str, bytes]) -> list[str]:
    return [pair[0], base64.b64encode(pair[1]).decode()]


def _untyped(value: object, what: str) -> tuple[str, bytes]:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)):
        raise CorruptDataError(f"checkpoint record: {what} is not a typed value")
    return value[0], base64.b64decode(value[1], validate=True)


def _doc(raw: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError:
        raise CorruptDataError(f"{what} is not JSON") from None
    if not isinstance(doc, dict):
        raise CorruptDataError(f"{what} is not a JSON object")
    return doc


class AgentStateSaver(BaseCheckpointSaver[str]):
    """LangGraph checkpoints as records of agentstate sessions (see the module docstring).

    `AgentStateSaver(store)` with a `StateStore` or `AsyncClient`, made inside the event loop it
    runs on (or pass `loop=`); `AgentStateSaver.connect(url, token)` for the session API (a vLLM
    engine's `serve_port`, or `agentstate serve`). Sync (`invoke`) and async (`ainvoke`) graphs both work.
    """

    def __init__(self, backend: SessionBackend | Bridge, *, serde: SerializerProtocol | None = None, loop: Any = None):
        super().__init__(serde=serde)
        self.bridge = backend if isinstance(backend, Bridge) else Bridge(backend, loop)

    @classmethod
    def connect(cls, url: str, token: str, *, serde: SerializerProtocol | None = None, **client_kw: Any) -> AgentStateSaver:
        return cls(Bridge.connect(url, token, **client_kw), serde=serde)

    def close(self) -> None:
        self.bridge.close()

    # -- names ---------------------------------------------------------------------------------

    @staticmethod
    def _where(config: RunnableConfig | None) -> tuple[str, str, str | None]:
        """(session, checkpoint_ns, checkpoint_id) of a config; InvalidArgumentError without a thread."""
        conf = (config or {}).get("configurable") or {}
        thread = conf.get("thread_id")
        if thread is None or thread == "":
            raise InvalidArgumentError("a LangGraph config needs configurable.thread_id to name its agentstate session")
        ns = conf.get("checkpoint_ns", "")
        if not isinstance(ns, str):
            raise InvalidArgumentError("configurable.checkpoint_ns must be a string")
        cid = conf.get("checkpoint_id")
        return session_for(thread), ns, None if cid is None else str(cid)

    @staticmethod
    def _cname(ns: str, cid: str) -> str:
        return f"{PREFIX}c/{_part(ns)}/{_part(cid)}"

    @staticmethod
    def _bname(ns: str, channel: str, version: object) -> str:
        return f"{PREFIX}b/{_part(ns)}/{_part(channel)}/{_part(str(version))}"

    @staticmethod
    def _wprefix(ns: str, cid: str) -> str:
        return f"{PREFIX}w/{_part(ns)}/{_part(cid)}/"

    # -- the operations, on the backend's loop ---------------------------------------------------

    async def _put(self, b: SessionBackend, config: RunnableConfig, checkpoint: Checkpoint,
                   metadata: CheckpointMetadata, new_versions: ChannelVersions) -> RunnableConfig:  # fmt: skip
        session, ns, parent = self._where(config)
        c = dict(checkpoint)
        values = c.pop("channel_values", {}) or {}
        items = {
            self._bname(ns, ch, ver): self._blob(self.serde.dumps_typed(values[ch]) if ch in values else ("empty", b""))
            for ch, ver in new_versions.items()
        }
        doc = {"ns": ns, "id": checkpoint["id"], "parent": parent, "checkpoint": _typed(self.serde.dumps_typed(c)),
               "metadata": _typed(self.serde.dumps_typed(get_checkpoint_metadata(config, metadata)))}  # fmt: skip
        items[self._cname(ns, checkpoint["id"])] = json.dumps(doc).encode()
        await b.put_records(session, items)
        thread = config["configurable"]["thread_id"]
        return {"configurable": {"thread_id": thread, "checkpoint_ns": ns, "checkpoint_id": checkpoint["id"]}}

    @staticmethod
    def _blob(pair: tuple[str, bytes]) -> bytes:
        return pair[0].encode() + b"\0" + pair[1]

    async def _put_writes(self, b: SessionBackend, config: RunnableConfig, writes: Sequence[tuple[str, Any]],
                          task_id: str, task_path: str) -> None:  # fmt: skip
        session, ns, cid = self._where(config)
        if cid is None:
            raise InvalidArgumentError("put_writes needs configurable.checkpoint_id")
        prefix = self._wprefix(ns, cid) + _part(task_id) + "/"
        there = set(await b.record_names(session, prefix))
        items = {}
        for i, (channel, value) in enumerate(writes):
            idx = WRITES_IDX_MAP.get(channel, i)
            name = f"{prefix}{idx:+011d}"
            if idx >= 0 and name in there:
                continue  # a regular write is kept as first written (a retried task writes it again)
            doc = {"task": task_id, "channel": channel, "path": task_path, "idx": idx,
                   "value": _typed(self.serde.dumps_typed(value))}  # fmt: skip
            items[name] = json.dumps(doc).encode()
        await b.put_records(session, items)

    async def _tuple(self, b: SessionBackend, thread: object, session: str, raw: bytes, name: str,
                     with_config: RunnableConfig | None = None) -> CheckpointTuple:  # fmt: skip
        doc = _doc(raw, name)
        ns, cid, parent = doc.get("ns"), doc.get("id"), doc.get("parent")
        if not isinstance(ns, str) or not isinstance(cid, str):
            raise CorruptDataError(f"{name}: no namespace or id")
        checkpoint = self.serde.loads_typed(_untyped(doc.get("checkpoint"), "checkpoint"))
        metadata = self.serde.loads_typed(_untyped(doc.get("metadata"), "metadata"))
        versions = checkpoint.get("channel_versions", {}) or {}
        names = {self._bname(ns, ch, ver): ch for ch, ver in versions.items()}
        blobs = await b.records(session, names=list(names)) if names else {}
        values = {}
        for bname, blob in blobs.items():
            kind, _, data = blob.partition(b"\0")
            if kind != b"empty":
                values[names[bname]] = self.serde.loads_typed((kind.decode(), data))
        writes = []
        for wname, wraw in (await b.records(session, self._wprefix(ns, cid))).items():
            w = _doc(wraw, wname)
            writes.append((str(w.get("path", "")), str(w.get("task")), int(w.get("idx", 0)), str(w.get("channel")),
                           self.serde.loads_typed(_untyped(w.get("value"), "write"))))  # fmt: skip
        writes.sort(key=lambda w: writes_sort_key(w[0], w[1], w[2]))
        here = {"configurable": {"thread_id": thread, "checkpoint_ns": ns, "checkpoint_id": cid}}
        return CheckpointTuple(
            config=with_config or here,  # type: ignore[arg-type]
            checkpoint={**checkpoint, "channel_values": values},
            metadata=metadata,
            parent_config=(
                {"configurable": {"thread_id": thread, "checkpoint_ns": ns, "checkpoint_id": parent}} if parent else None
            ),  # type: ignore[arg-type]
            pending_writes=[(task, channel, value) for _, task, _, channel, value in writes],
        )

    async def _get_tuple(self, b: SessionBackend, config: RunnableConfig) -> CheckpointTuple | None:
        session, ns, cid = self._where(config)
        thread = config["configurable"]["thread_id"]
        if cid is None:
            ids = await b.record_names(session, f"{PREFIX}c/{_part(ns)}/")
            if not ids:
                return None
            name = max(ids, key=lambda n: self._id_of(n))
        else:
            name = self._cname(ns, cid)
        found = await b.records(session, names=[name])
        if name not in found:
            return None
        return await self._tuple(b, thread, session, found[name], name, config if cid is not None else None)

    @staticmethod
    def _id_of(name: str) -> str:
        return unquote(name.rsplit("/", 1)[1])

    async def _list(self, b: SessionBackend, config: RunnableConfig | None, filter: dict[str, Any] | None,
                    before: RunnableConfig | None, limit: int | None) -> list[CheckpointTuple]:  # fmt: skip
        if config is None:
            raise InvalidArgumentError("list needs a config naming a thread (configurable.thread_id)")
        session, ns, cid = self._where(config)
        thread = config["configurable"]["thread_id"]
        conf = config.get("configurable") or {}
        prefix = f"{PREFIX}c/{_part(ns)}/" if "checkpoint_ns" in conf else f"{PREFIX}c/"
        names = sorted(await b.record_names(session, prefix), key=self._id_of, reverse=True)
        if cid is not None:
            names = [n for n in names if self._id_of(n) == cid]
        if before is not None:
            bid = ((before.get("configurable") or {}).get("checkpoint_id"))
            if bid is not None:
                names = [n for n in names if self._id_of(n) < str(bid)]
        out: list[CheckpointTuple] = []
        for name in names:
            if limit is not None and len(out) >= limit:
                break
            found = await b.records(session, names=[name])
            if name not in found:
                continue  # deleted meanwhile
            tup = await self._tuple(b, thread, session, found[name], name)
            if filter and not all(tup.metadata.get(k) == v for k, v in filter.items()):
                continue
            out.append(tup)
        return out

    async def _delete_thread(self, b: SessionBackend, thread_id: str) -> None:
        try:
            await b.delete(session_for(thread_id))
        except SessionNotFoundError:
            pass

    async def _copy_thread(self, b: SessionBackend, source: str, target: str) -> None:
        src, dst = session_for(source), session_for(target)
        try:
            await b.fork(src, dst)  # KV and records, the KV shared
        except SessionNotFoundError:
            found = await b.records(src, PREFIX)
            if found:
                await b.put_records(dst, found)

    async def _prune(self, b: SessionBackend, thread_ids: Sequence[str], strategy: str) -> None:
        """`keep_latest`: each namespace's newest checkpoint, its channel values and its writes stay,
        the rest of the thread's records go; `delete`: all of them (the session's KV stays)."""
        if strategy not in ("keep_latest", "delete"):
            raise InvalidArgumentError(f"unknown prune strategy {strategy!r}: keep_latest or delete")
        for thread in thread_ids:
            session = session_for(thread)
            names = await b.record_names(session, PREFIX)
            keep: set[str] = set()
            if strategy == "keep_latest":
                newest: dict[str, str] = {}
                for name in (n for n in names if n.startswith(f"{PREFIX}c/")):
                    ns_part = name[len(PREFIX) + 2 :].rsplit("/", 1)[0]
                    if ns_part not in newest or self._id_of(name) > self._id_of(newest[ns_part]):
                        newest[ns_part] = name
                for name, raw in (await b.records(session, names=list(newest.values()))).items():
                    doc = _doc(raw, name)
                    checkpoint = self.serde.loads_typed(_untyped(doc.get("checkpoint"), "checkpoint"))
                    ns, cid = str(doc.get("ns")), str(doc.get("id"))
                    keep.add(name)
                    keep.update(self._bname(ns, ch, v) for ch, v in (checkpoint.get("channel_versions") or {}).items())
                    keep.update(n for n in names if n.startswith(self._wprefix(ns, cid)))
            gone = [n for n in names if n not in keep]
            if gone:
                await b.delete_records(session, gone)

    # -- BaseCheckpointSaver ---------------------------------------------------------------------

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        self.bridge.call_sync(lambda b: self._prune(b, thread_ids, strategy))

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await self.bridge.call(lambda b: self._prune(b, thread_ids, strategy))

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return self.bridge.call_sync(lambda b: self._get_tuple(b, config))

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await self.bridge.call(lambda b: self._get_tuple(b, config))

    def list(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
             before: RunnableConfig | None = None, limit: int | None = None) -> Iterator[CheckpointTuple]:  # fmt: skip
        yield from self.bridge.call_sync(lambda b: self._list(b, config, filter, before, limit))

    async def alist(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
                    before: RunnableConfig | None = None, limit: int | None = None) -> AsyncIterator[CheckpointTuple]:  # fmt: skip
        for tup in await self.bridge.call(lambda b: self._list(b, config, filter, before, limit)):
            yield tup

    def put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
            new_versions: ChannelVersions) -> RunnableConfig:  # fmt: skip
        return self.bridge.call_sync(lambda b: self._put(b, config, checkpoint, metadata, new_versions))

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
                   new_versions: ChannelVersions) -> RunnableConfig:  # fmt: skip
        return await self.bridge.call(lambda b: self._put(b, config, checkpoint, metadata, new_versions))

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                   task_path: str = "") -> None:  # fmt: skip
        self.bridge.call_sync(lambda b: self._put_writes(b, config, writes, task_id, task_path))

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                          task_path: str = "") -> None:  # fmt: skip
        await self.bridge.call(lambda b: self._put_writes(b, config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        self.bridge.call_sync(lambda b: self._delete_thread(b, thread_id))

    async def adelete_thread(self, thread_id: str) -> None:
        await self.bridge.call(lambda b: self._delete_thread(b, thread_id))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self.bridge.call_sync(lambda b: self._copy_thread(b, source_thread_id, target_thread_id))

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await self.bridge.call(lambda b: self._copy_thread(b, source_thread_id, target_thread_id))

    def get_next_version(self, current: str | None, channel: None) -> str:
        """Versions as LangGraph's own savers make them: a zero-padded counter, then a random tie-breaker."""
        import random

        n = 0 if current is None else int(current) if isinstance(current, int) else int(str(current).split(".")[0])
        return f"{n + 1:032}.{random.random():016}"


class AgentStateHints(BaseCallbackHandler):
    """LangChain callbacks that tell agentstate when a thread's tool calls start and end (see the
    module docstring). Pass it in the run's config: `graph.invoke(x, {"configurable": {"thread_id":
    t}, "callbacks": [AgentStateHints(saver.bridge)]})`."""

    def __init__(self, bridge: Bridge, clock: ToolClock | None = None, *, priority: int | None = None) -> None:
        """`priority`: the scheduling priority of a thread's first model call after a tool returns
        (`openai_channel.mark_resuming`; for a vLLM server run with `--scheduling-policy priority`)."""
        self.hinter = Hinter(bridge)
        self.clock = clock or ToolClock()
        self.priority = priority
        self._threads: dict[UUID, str] = {}

    @staticmethod
    def _thread(metadata: dict[str, Any] | None) -> str | None:
        thread = (metadata or {}).get("thread_id")
        return None if thread is None else session_for(thread)

    def on_tool_start(self, serialized: dict[str, Any], input_str: str, *, run_id: UUID,
                      metadata: dict[str, Any] | None = None, **kw: Any) -> None:  # fmt: skip
        session = self._thread(metadata)
        if session is None:
            return
        tool = str((serialized or {}).get("name") or kw.get("name") or "tool")
        self.clock.started(str(run_id), tool)
        self._threads[run_id] = session
        declared = (metadata or {}).get("expected_s")
        self.hinter.send(session, "paused", self.clock.expected_s(tool, declared))

    def on_tool_end(self, output: Any, *, run_id: UUID, **kw: Any) -> None:
        self.clock.ended(str(run_id))
        session = self._threads.pop(run_id, None)
        if session is not None:
            self.hinter.send(session, "resuming")
            if self.priority is not None:
                mark_resuming(session, self.priority)

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kw: Any) -> None:
        self.on_tool_end(None, run_id=run_id)

    def on_chain_start(self, serialized: dict[str, Any] | None, inputs: Any, *, run_id: UUID,
                       parent_run_id: UUID | None = None, metadata: dict[str, Any] | None = None, **kw: Any) -> None:  # fmt: skip
        if parent_run_id is None:  # the graph's run itself
            session = self._thread(metadata)
            if session is not None:
                self._threads[run_id] = session

    def on_chain_end(self, outputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kw: Any) -> None:
        if parent_run_id is None:
            session = self._threads.pop(run_id, None)
            if session is not None:
                self.hinter.send(session, "done")
