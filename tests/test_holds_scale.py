"""Holds at scale: a hint's cost does not grow with the number of live holds (issue 25, item 7), and
the incremental plan answers exactly what a plan computed from scratch over every hold answers.

The cost is measured as an operation count, not a time: the lines of `agentstate/chunks/holds.py`
a real hint on a real store (host tier over LMDB) executes, with 100 and with 20,000 other holds live
(distinct agent ids of one tenant over a shared prefix, what the vLLM connector places).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agentstate import StateStore
from agentstate.chunks import holds as holds_module
from agentstate.chunks.holds import Holds, victim
from agentstate.config import StoreConfig, TierConfig
from tests.conftest import SPEC4, random_kv, random_tokens

# -- the reference: every answer computed from scratch over all live holds ----------------------


@dataclass(frozen=True)
class _RefHold:
    owner: str
    keys: tuple[str, ...]
    until: float
    back_at: float


class Reference:
    """The plan as documented in `holds.py`, by brute force: for each key the min over all its live
    holds, each owner's share filled in (back_at, first held) order, skipping what does not fit."""

    def __init__(self, share: float, clock: Callable[[], float]) -> None:
        self.share, self.clock = share, clock
        self.by_name: dict[str, _RefHold] = {}
        self.by_key: dict[str, set[str]] = {}  # insertion order: since when a key is held

    def expire(self) -> None:
        now = self.clock()
        for name in [n for n, h in self.by_name.items() if h.until <= now]:
            self.drop(name)

    def set(self, name: str, owner: str, keys: Iterable[str], for_s: float, back_in_s: float) -> None:
        self.expire()
        self.drop(name)
        now = self.clock()
        hold = _RefHold(owner, tuple(dict.fromkeys(k for k in keys if k)), now + for_s, now + back_in_s)
        self.by_name[name] = hold
        for key in hold.keys:
            self.by_key.setdefault(key, set()).add(name)

    def drop(self, name: str) -> None:
        hold = self.by_name.pop(name, None)
        for key in hold.keys if hold else ():
            self.by_key[key].discard(name)
            if not self.by_key[key]:
                del self.by_key[key]

    def plan(self, sizes: Mapping[str, int], capacity: int | None) -> dict[str, float]:
        self.expire()
        best = {
            key: min((self.by_name[n].back_at, self.by_name[n].owner) for n in names)
            for key, names in self.by_key.items()
            if key in sizes
        }
        if capacity is None or self.share >= 1.0:
            return {k: back for k, (back, _) in best.items()}
        spent: dict[str, int] = {}
        counted: dict[str, float] = {}
        for key, (back, owner) in sorted(best.items(), key=lambda item: item[1][0]):  # stable: by_key order
            if spent.get(owner, 0) + sizes[key] <= self.share * capacity:
                spent[owner] = spent.get(owner, 0) + sizes[key]
                counted[key] = back
        return counted

    def held_bytes(self, owner: str, sizes: Mapping[str, int], capacity: int | None) -> int:
        mine = {k for h in self.by_name.values() if h.owner == owner for k in h.keys}
        return sum(sizes[k] for k in self.plan(sizes, capacity) if k in mine)


def eviction(lru: dict[str, int], plan: Mapping[str, float]) -> list[str]:
    """Every key of `lru` in the order `victim` takes them (evicting on a copy)."""
    left, order = dict(lru), []
    while left:
        key = victim(left, lambda k: True, {k: b for k, b in plan.items() if k in left})
        assert key is not None
        order.append(key)
        del left[key]
    return order


KEYS = [f"k{i}" for i in range(12)]
OWNERS = ["a", "b", "c"]
op = st.one_of(
    st.tuples(
        st.just("set"), st.sampled_from([f"n{i}" for i in range(8)]), st.sampled_from(OWNERS),
        st.lists(st.sampled_from(KEYS), max_size=6), st.sampled_from([0.5, 1.0, 3.0, 100.0]),
        st.sampled_from([-math.inf, 0.0, 1.0, 2.0, math.inf]),
    ),
    st.tuples(st.just("drop"), st.sampled_from([f"n{i}" for i in range(8)])),
    st.tuples(st.just("tick"), st.sampled_from([0.25, 0.5, 1.0, 2.0])),
    st.tuples(st.just("enter"), st.sampled_from(KEYS), st.sampled_from([1, 2, 3, 5, 8])),
    st.tuples(st.just("leave"), st.sampled_from(KEYS)),
)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, max_size=80), share=st.sampled_from([0.25, 0.4, 0.5, 1.0]), capacity=st.sampled_from([8, 20]),
    block=st.sampled_from([1, 2, 64]),
)  # fmt: skip
@example(  # past the first key that does not fit, a later block's smallest key fits exactly
    ops=[("enter", "k0", 3), ("enter", "k1", 5), ("enter", "k2", 8), ("enter", "k3", 2),
         ("set", "n0", "a", ["k0", "k1", "k2", "k3"], 100.0, 1.0)],
    share=0.25, capacity=20, block=1,
)  # fmt: skip
def test_the_incremental_plan_equals_the_brute_force_one(
    ops: list[tuple[Any, ...]], share: float, capacity: int, block: int
) -> None:
    """Random holds (shared keys, several owners, ties, expiry) over a tier whose keys come and go:
    plan, held bytes and eviction order are exactly the reference's, after every step (with blocks
    of 1 and 2 keys too, so that blocks split, empty and are skipped as a tier's worth would)."""
    default = holds_module._Ranked.BLOCK
    holds_module._Ranked.BLOCK = block
    try:
        _replay(ops, share, capacity)
    finally:
        holds_module._Ranked.BLOCK = default


def _replay(ops: list[tuple[Any, ...]], share: float, capacity: int) -> None:
    now = [0.0]
    holds, ref = Holds(share=share, clock=lambda: now[0]), Reference(share, lambda: now[0])
    lru: dict[str, int] = {}
    holds.track(lru)
    for step in ops:
        if step[0] == "set":
            _, name, owner, keys, for_s, back = step
            holds.set(name, owner, keys, for_s=for_s, back_in_s=back)
            ref.set(name, owner, keys, for_s, back)
        elif step[0] == "drop":
            holds.drop(step[1])
            ref.drop(step[1])
        elif step[0] == "tick":
            now[0] += step[1]
        elif step[0] == "enter" and step[1] not in lru:
            lru[step[1]] = step[2]
            holds.tier_changed(lru, [step[1]])
        elif step[0] == "leave" and step[1] in lru:
            del lru[step[1]]
            holds.tier_changed(lru, [step[1]])
        want = ref.plan(lru, capacity)
        assert dict(holds.plan(lru, capacity)) == want
        assert holds.plan(dict(lru), capacity) == want  # the same answer for a tier not tracked
        assert {o: holds.held_bytes(o, lru, capacity) for o in OWNERS} == {
            o: ref.held_bytes(o, lru, capacity) for o in OWNERS
        }
        assert eviction(lru, holds.plan(lru, capacity)) == eviction(lru, want)
        assert all(holds.held(k) == (k in ref.by_key) for k in KEYS)
        assert {o: set(holds.owned(o)) for o in OWNERS} == {
            o: {n for n, h in ref.by_name.items() if h.owner == o} for o in OWNERS
        }


def test_replaced_holds_leave_bounded_memory() -> None:
    """A connector replaces each agent's hold at every turn: the dead entries that leaves in the
    per-key heaps and the heap of ends are compacted, so memory follows the live holds."""
    holds = Holds(share=0.5)
    lru = {"shared": 4, "mine": 4}
    holds.track(lru)
    for turn in range(2_000):
        holds.set(f"agent-{turn % 10}", "t", ["shared", f"own-{turn % 10}"], for_s=900, back_in_s=turn % 13)
    assert len(holds) == 10
    assert len(holds._keys["shared"].heap) <= 2 * 10 + 9 and len(holds._ends) <= 2 * 10 + 65
    ref = Reference(0.5, time.monotonic)
    for name, hold in holds._by_name.items():
        ref.by_name[name] = _RefHold(hold.owner, hold.keys, hold.until, hold.back_at)
        for key in hold.keys:
            ref.by_key.setdefault(key, set()).add(name)
    assert dict(holds.plan(lru, 8)) == ref.plan(lru, 8) and holds.held_bytes("t", lru, 8) == 4


# -- the cost of a hint: lines executed in holds.py ---------------------------------------------

CHUNK = 64
PROMPT = 8 * CHUNK  # a shared system prompt of 8 chunks, in the host tier


async def _hint_cost(root: Path, others: int) -> list[int]:
    """Lines of holds.py that hints on a real store execute with `others` holds live."""
    cfg = StoreConfig(
        path=root, chunk_tokens=CHUNK, lmdb_map_size=64 << 20,
        tiers=[TierConfig(kind="host", capacity_bytes=CHUNK * SPEC4.token_bytes * 40), TierConfig(kind="lmdb")],
    )  # fmt: skip
    async with StateStore.open(cfg, SPEC4) as store:
        prompt = random_tokens(PROMPT, seed=1)
        await store.put_prefix(prompt, random_kv(SPEC4, PROMPT, seed=1))
        keys = list(store.chunk_keys(prompt))  # what the connector's prefix hints hold: the stored prefix
        for i in range(others):  # distinct agent ids over the shared prefix, each with its own turns
            store.chunks.hold(
                f"prefix:default/agent-{i}", "default", [*keys, f"own-{i}-a", f"own-{i}-b"],
                for_s=900, back_in_s=600 + i % 7,
            )  # fmt: skip
        costs = []
        for name, hint in [("new-1", "paused"), ("agent-3", "paused"), ("new-2", "resuming"), ("new-1", "done")]:
            costs.append(await _traced(store.hint_tokens(name, prompt, hint, 30.0 if hint == "paused" else None)))
        return costs


async def _traced(awaitable: Awaitable[Any]) -> int:
    """Lines of holds.py executed while `awaitable` runs on this loop."""
    target = holds_module.__file__
    count = [0]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            count[0] += 1
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == target else None

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        await awaitable
    finally:
        sys.settrace(old)
    return count[0]


async def test_a_hint_costs_the_same_with_100_or_20000_holds_live(tmp_path: Path) -> None:
    few = await _hint_cost(tmp_path / "few", 100)
    many = await _hint_cost(tmp_path / "many", 20_000)
    assert few == many, f"lines of holds.py per hint: {few} with 100 holds, {many} with 20,000"
    assert max(many) < 2_000
