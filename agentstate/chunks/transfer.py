"""Moving chunks between tiers and KV targets: batched, bounded in flight, copied once.

Reads go to the fastest tier the index says holds each chunk; each value is checked by the
codec and copied straight from the backend's memory into the target. A chunk missing or corrupt
on one tier is retried on the next; a corrupt copy is deleted (counted, logged) so a later store
rewrites it. Writes encode on a thread pool into huge-page buffers and go to the tiers the write
policy names.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from agentstate import codec, layouts
from agentstate.chunks.io import IOEngine, batches
from agentstate.chunks.tiers import Tier, TierManager, Value
from agentstate.errors import AgentStateError, InvalidArgumentError, SpecMismatchError
from agentstate.layouts import NativeKV
from agentstate.memory import Buffer, copy_bytes, host_buffer
from agentstate.spec import ModelSpec
from agentstate.target import KVTarget

if TYPE_CHECKING:
    import torch

log = logging.getLogger("agentstate.chunks.transfer")
Span = tuple[int, int]  # (first token, number of tokens)


class Transfer:
    def __init__(
        self,
        *,
        spec: ModelSpec,
        manager: TierManager,
        io: IOEngine,
        pool: ThreadPoolExecutor,
        batch_bytes: int,
        promote: bool,
        read_only: bool = False,
        buffer: Callable[[int], Buffer] = host_buffer,
        recycle: Callable[[object], bool] = lambda value: False,
    ) -> None:
        """`buffer(n)`: where a value is written (the host tier's arena, or a recycled buffer);
        `recycle(value)`: offered each encoded value once it is stored."""
        self.buffer = buffer
        self.recycle = recycle
        self.spec = spec
        self.fingerprint = spec.fingerprint
        self.manager = manager
        self.io = io
        self.pool = pool
        self.batch_bytes = batch_bytes
        self.promote = promote
        self.counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self.read_only = read_only
        self._background: set[asyncio.Future[object]] = set()

    async def _forget(self, tier: Tier, missing: list[str], corrupt: list[str], limits: dict[str, int]) -> None:
        """Drop what a read found absent or damaged, so the next store rewrites it; never raises.

        A remote tier's "missing" may be a node that failed or another host's delete, not absence:
        it is only forgotten by the index, never deleted there. Cleanup that fails (the tier is
        down) is counted and left for the next read or gc: it must not fail a restore.
        """
        if self.read_only:  # a reader of a directory it does not own never deletes: forget only
            self.manager.index.discard(missing + corrupt, tier.name)
            return
        doomed: list[str] = []
        try:
            if tier.backend.remote:
                self.manager.note(tier, missing, [False] * len(missing))
                doomed = corrupt
            else:
                doomed = [k for k in missing if not await self._foreign(tier, k, limits[k])] + corrupt
            if not doomed:
                return
            await self.manager.delete(doomed, [tier])
        except AgentStateError as exc:
            self.counts["cleanup_errors"] += 1
            log.warning("tier %s: dropping %d bad chunks failed (%s); a later read or gc retries", tier.name,
                        len(doomed), exc)  # fmt: skip

    async def _foreign(self, tier: Tier, key: str, limit: int) -> bool:
        """A key a local tier's read did not get is still there, intact under its own header: longer
        than the read's bound, a value of another spec of this model (a hybrid state asked for as KV,
        a wider slice of heads) that is not this reader's to drop. `limit`: the largest such value
        (read no further: a compressed tier's bomb stays a bomb). A value that is there and damaged,
        or longer than any of this model's, is not foreign: dropped."""
        if not (await tier.backend.exists([key]))[0]:
            return False
        got: list[bool] = []
        await tier.backend.read_bounded([key], lambda _, view: got.append(codec.intact(view, key=key)), [limit])
        return bool(got and got[0])

    def _largest(self, tokens: int) -> int:
        """The largest value a key of `tokens` tokens may hold under any spec of this model: the whole
        model's KV (every TP slice is smaller), or a hybrid model's state."""
        state = self.spec.state.nbytes_at(1 << 40) if self.spec.state is not None else 0
        return codec.encoded_size(max(tokens * self.spec.whole.token_bytes, state))

    def _chunk_bytes(self, tokens: int, spec: ModelSpec | None = None) -> int:
        return codec.encoded_size(tokens * (spec or self.spec).token_bytes)

    # -- reads ---------------------------------------------------------------------------------

    async def read(
        self, keys: Sequence[str], spans: Sequence[Span], target: KVTarget, *, staged: dict[str, Value] | None = None,
        usage: Counter[str] | None = None, lossy: set[str] | None = None, stored: Sequence[int] | None = None,
    ) -> list[bool]:  # fmt: skip
        """Restore chunk `keys[i]` into `target` at `spans[i]`; which ones arrived intact.

        Chunks in `staged` (checked buffers a prefetch already holds) are copied from there.
        Keys whose restored bytes were a lossy reconstruction (codec.FLAG_LOSSY) are added to `lossy`.
        `stored[i]`: the tokens chunk i holds, when the span restores only its first `spans[i][1]`
        (KV of a token depends on the tokens before it only, so a chunk's first tokens are those of
        any sequence that starts the same); default: the span's own count.
        """
        held = [n for _, n in spans] if stored is None else [int(s) for s in stored]
        if len(held) != len(keys) or any(h < n for h, (_, n) in zip(held, spans)):
            raise InvalidArgumentError("stored: one token count per key, at least its span's")
        ok = [False] * len(keys)
        from_staged = [i for i, k in enumerate(keys) if staged and k in staged]
        if from_staged:
            assert staged is not None

            def copy() -> None:
                for i in from_staged:
                    src = codec.decode_native(
                        staged[keys[i]], key=keys[i], fingerprint=self.fingerprint, dtype=self.spec.torch_dtype,
                        shape=self.spec.kv_shape(held[i]), verify=False,
                    )  # fmt: skip
                    place(target, spans[i][0], spans[i][1], self._as(target.native_layout, src))
                    ok[i] = True
                    if lossy is not None and codec.is_lossy(staged[keys[i]]):
                        lossy.add(keys[i])

            await asyncio.get_running_loop().run_in_executor(self.pool, copy)
            if usage is not None:
                usage["bytes_read:staged"] += sum(len(staged[keys[i]]) for i in from_staged)
        rest = [i for i in range(len(keys)) if not ok[i]]

        def into_target(j: int, src: torch.Tensor | NativeKV) -> None:
            start, n = spans[rest[j]]
            place(target, start, n, src)

        got = await self._read([keys[i] for i in rest], [held[i] for i in rest], into_target, usage=usage, lossy=lossy,
                               native=target.native_layout)  # fmt: skip
        for i, good in zip(rest, got):
            ok[i] = good
        return ok

    async def read_as(
        self, spec: ModelSpec, keys: Sequence[str], tokens: Sequence[int], deliver: Callable[[int, torch.Tensor], None],
        lossy: set[str] | None = None,
    ) -> list[bool]:
        """Read chunks another slice of this model's heads stored (`spec`: that slice's) and hand
        each to `deliver(i, canonical KV)` in a pool thread, a view valid only during the call; never
        promoted (the reader stores what it makes of them under its own keys)."""
        return await self._read(keys, tokens, lambda i, src: deliver(i, self._as(None, src)),  # type: ignore[arg-type]
                                promote=False, spec=spec, lossy=lossy)  # fmt: skip

    def _as(self, native: int | None, src: torch.Tensor | NativeKV) -> torch.Tensor | NativeKV:
        """`src` as the target takes it: its own layout as it is, any other converted to canonical
        KV (a copy, counted: `layout_conversions`)."""
        if isinstance(src, NativeKV) and src.layout != native:
            with self._counts_lock:  # runs in the pool's threads
                self.counts["layout_conversions"] += 1
            return layouts.to_canonical(src.data, src.layout, src.shape)
        return src

    def read_held(
        self, tier: Tier, keys: Sequence[str], tokens: Sequence[int], deliver: Callable[[int, torch.Tensor], None]
    ) -> list[bool]:
        """Chunks an in-process memory tier holds (`Backend.peek`), decoded and handed to `deliver(i,
        canonical KV)` in the calling thread, whatever thread that is; False for the others (absent,
        or a copy that does not check out: `read` them, which drops a bad copy). Accounting is the
        caller's: `account_held` on the loop."""
        ok = []
        for i, key in enumerate(keys):
            value = tier.backend.peek(key)  # held here: the buffer is not reused while we copy from it
            if value is None:
                ok.append(False)
                continue
            try:
                src = codec.decode_native(
                    value, key=key, fingerprint=self.fingerprint, dtype=self.spec.torch_dtype,
                    shape=self.spec.kv_shape(tokens[i]), verify=not tier.backend.trusted,
                )  # fmt: skip
            except AgentStateError:
                ok.append(False)
                continue
            deliver(i, self._as(None, src))  # type: ignore[arg-type]  # canonical: _as(None) converts
            ok.append(True)
        return ok

    def account_held(self, tier: Tier, keys: Sequence[str]) -> None:
        """On the loop: what `read_held` served counts as hits of `tier` (LRU, counters), as a read would."""
        self.counts["chunks_read"] += len(keys)
        self.manager.count(tier, hits=len(keys))
        held = [k for k in keys if self.manager.index.holds(k, tier.name)]  # evicted meanwhile: nothing to touch
        if held:
            self._spawn(self.manager.hit(tier, held, {}))

    async def fetch(self, keys: Sequence[str], tokens: Sequence[int], *, promote: bool = True) -> dict[str, Value]:
        """Read and check chunks into owned host buffers (staging for prefetch); `promote=False`
        leaves promotion to the caller (which puts them where it wants)."""
        staged: dict[str, Value] = {}
        await self._read(keys, tokens, None, staged, promote=promote)
        return staged

    async def _read(
        self,
        keys: Sequence[str],
        tokens: Sequence[int],
        deliver: Callable[[int, torch.Tensor | NativeKV], None] | None,
        staged: dict[str, Value] | None = None,
        *,
        usage: Counter[str] | None = None,
        promote: bool = True,
        lossy: set[str] | None = None,
        native: int | None = None,
        spec: ModelSpec | None = None,
    ) -> list[bool]:
        """Read `keys` from the fastest tier holding an intact copy; `deliver(i, src)` gets chunk i as
        canonical KV, or as `NativeKV` where it is stored in layout `native` (the target's own).
        `spec`: the keys hold chunks of another slice of this model's heads (`read_as`)."""
        ok = [False] * len(keys)
        pending = list(range(len(keys)))
        index = self.manager.index
        await self.manager.discover([k for k in keys if not index.tiers_of(k)])
        for tier in self.manager.tiers:
            if not pending:
                break
            if tier.lazy:  # what failed above (a damaged copy) may still be here: asked, not assumed absent
                await self.manager.known_in(tier, [keys[i] for i in pending])
            todo = [i for i in pending if index.holds(keys[i], tier.name)]
            if todo:
                got = await self._read_tier(
                    tier, [keys[i] for i in todo], [tokens[i] for i in todo], _remap(deliver, todo), staged,
                    usage=usage, promote=promote, lossy=lossy, native=native, spec=spec,
                )  # fmt: skip
                for i, good in zip(todo, got):
                    ok[i] = good
            # A miss of a tier: a chunk that reached it (no faster tier served it) and that it did not serve.
            served = sum(ok[i] for i in todo)
            self.manager.count(tier, hits=served, misses=len(pending) - served)
            pending = [i for i in pending if not ok[i]]
        self.counts.update(chunks_read=sum(ok), chunk_misses=len(keys) - sum(ok))
        return ok

    async def _read_tier(
        self,
        tier: Tier,
        keys: list[str],
        tokens: list[int],
        deliver: Callable[[int, torch.Tensor | NativeKV], None] | None,
        staged: dict[str, Value] | None,
        account: bool = True,
        *,
        usage: Counter[str] | None = None,
        promote: bool = True,
        lossy: set[str] | None = None,
        native: int | None = None,
        spec: ModelSpec | None = None,
    ) -> list[bool]:
        spec = spec or self.spec
        status = ["missing"] * len(keys)
        sizes_read = [0] * len(keys)
        owned: dict[str, Value] = {}
        promote = self.promote and promote
        upper = tier is not self.manager.tiers[0]
        # A remote tier's bytes are kept as they arrive when they will be promoted: a copy into a
        # (recycled) host buffer now costs less than reading every chunk over the network again.
        keep_copy = staged is not None or (promote and upper and tier.backend.remote)
        verify = not tier.backend.trusted
        dtype = spec.torch_dtype

        def reader(run: list[int]) -> Callable[[], Awaitable[list[bool]]]:
            def sink(j: int, view: memoryview) -> None:
                i = run[j]
                try:
                    src = codec.decode_native(
                        view,
                        key=keys[i],
                        fingerprint=spec.fingerprint,
                        dtype=dtype,
                        shape=spec.kv_shape(tokens[i]),
                        verify=verify,
                    )
                    if deliver is not None:
                        deliver(i, self._as(native, src))
                except SpecMismatchError as exc:  # another spec's value, intact: not ours to serve, nor to drop
                    status[i] = "foreign" if codec.intact(view, key=keys[i]) else f"corrupt: {exc}"
                    return
                except AgentStateError as exc:
                    status[i] = f"corrupt: {exc}"
                    return
                status[i] = "ok"
                sizes_read[i] = len(view)
                if lossy is not None and codec.is_lossy(view):
                    lossy.add(keys[i])
                if keep_copy:
                    owned[keys[i]] = copy_bytes(view, self.buffer(len(view)))

            # The largest valid value of each key bounds the read: a remote tier refuses a longer one
            # before it allocates or receives it (a forged length is a miss, not hundreds of MiB).
            return lambda: tier.backend.read_bounded([keys[i] for i in run], sink, [sizes[i] for i in run])

        sizes = [self._chunk_bytes(n, spec) for n in tokens]
        await self.io.gather([reader(run) for run in batches(sizes, self.batch_bytes)])

        missing = [keys[i] for i, s in enumerate(status) if s == "missing"]
        corrupt = [keys[i] for i, s in enumerate(status) if s.startswith("corrupt")]
        for i, s in enumerate(status):
            if s.startswith("corrupt"):
                log.warning("tier %s: chunk %s is %s; treating it as a miss and dropping it", tier.name, keys[i], s)
        if corrupt:
            self.counts["corrupt"] += len(corrupt)
            self.manager.count(tier, corrupt=len(corrupt))
        if account:
            self.manager.count(tier, read_bytes=sum(sizes_read))
        if usage is not None:
            usage[f"bytes_read:{tier.name}"] += sum(sizes_read)
        limits = {keys[i]: self._largest(tokens[i]) for i, s in enumerate(status) if s == "missing"}
        await self._forget(tier, missing, corrupt, limits)
        if staged is not None:
            staged.update(owned)
        good = [i for i, s in enumerate(status) if s == "ok"]
        await self.manager.hit(tier, [keys[i] for i in good], owned if promote else {}, account=account)
        if promote and not keep_copy and good and upper:
            # Promote off the critical path: re-read the (now warm, local) chunks into owned buffers later.
            self._spawn(self._read_tier(tier, [keys[i] for i in good], [tokens[i] for i in good], None, {}, False))
        return [s == "ok" for s in status]

    def _spawn(self, work: Awaitable[object]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def flush(self) -> None:
        """Wait for background work (promotions) started so far."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    # -- writes --------------------------------------------------------------------------------

    async def write(
        self, keys: Sequence[str], chunks: Sequence[torch.Tensor | NativeKV], *, durable: bool,
        spec: ModelSpec | None = None,
    ) -> int:  # fmt: skip
        """Encode `chunks` and store them where the write policy says; returns encoded bytes.
        `spec`: the values are another spec's (a hybrid state's, `ModelSpec.state_spec`).

        Pipelined: each batch goes to the tiers as soon as it is encoded, so encoding batch i+1
        overlaps writing batch i (encoding alone is a copy into fresh memory plus a checksum: as
        long as the disk write when run one after the other). The record tier group-commits
        whatever batches are waiting, so a snapshot costs a few synced commits, not one per batch;
        every batch is durable before `write` returns, and the caller commits its manifest only
        after that, so a crash leaves the old session or the new one (chunks of a snapshot that
        never committed are garbage that gc removes).
        """
        sizes = [codec.encoded_size(codec.payload_bytes(c)) for c in chunks]
        loop = asyncio.get_running_loop()
        fingerprint = (spec or self.spec).fingerprint

        def encode(run: list[int]) -> list[Value]:
            return [codec.encode(chunks[i], fingerprint, key=keys[i], out=self.buffer(sizes[i])) for i in run]

        async def job(run: list[int]) -> None:
            # The IO engine bounds the encodes in flight, not the writes: a batch waiting for its
            # group commit must not keep the next one from encoding.
            values = await self.io.run(lambda: loop.run_in_executor(self.pool, encode, run))
            await self.manager.store([keys[i] for i in run], values, durable=durable)
            while values:  # stored: a buffer no tier kept serves the next encode (no fresh memory)
                self.recycle(values.pop())

        jobs = [asyncio.ensure_future(job(run)) for run in batches(sizes, self.batch_bytes)]
        try:
            await asyncio.gather(*jobs)
        except BaseException:
            for pending in jobs:
                pending.cancel()
            raise
        self.counts["bytes_written"] += sum(sizes)
        return sum(sizes)


def place(target: KVTarget, start: int, n: int, src: torch.Tensor | NativeKV) -> None:
    """The first `n` tokens of chunk `src` into `target` at token `start`."""
    if isinstance(src, NativeKV):
        target.write_native(start, n, src)
    else:
        target.write(start, src if n == src.shape[2] else src[:, :, :n])


def _remap(
    deliver: Callable[[int, torch.Tensor | NativeKV], None] | None, positions: list[int]
) -> Callable[[int, torch.Tensor | NativeKV], None] | None:
    """`deliver` addressed by position in a sub-list instead of in the whole request."""
    if deliver is None:
        return None
    return lambda j, src: deliver(positions[j], src)
