"""Batched reads and writes of the Mooncake tier through one arena slot (run on a worker thread).

Plain functions over the client, apart from the backend's timeouts and breaker: they do the
packing, the per-key return codes, and the fallback to plain get/upsert for oversized values.
Every touch of caller memory (a sink, a value to copy) happens under the call's Guard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentstate.backends.base import ReadSink
from agentstate.backends.mooncake_io import Guard, Slot

Value = bytes | bytearray | memoryview

# Return codes of the client (mooncake's ErrorCode), checked against a live store.
NO_SPACE = -200  # no segment can hold the value (NO_AVAILABLE_HANDLE)
INVALID = -600  # bad parameters; also a destination buffer too small for the value
MISSING = -704  # no such object (OBJECT_NOT_FOUND)
MIN_SHARE = 64 << 10  # the least slot space a key is given in one batched read


def outage(code: int) -> bool:
    """A code that says the call failed (as opposed to success or a plain miss)."""
    return code < 0 and code != MISSING


def fetch(client: Any, slot: Slot, guard: Guard, names: Sequence[str], sink: ReadSink, found: list[bool]) -> int:
    """Read `names` into the slot with batch_get_into, each key given an equal share (sizes are
    not known up front), and hand each value to `sink` from there. Values larger than their
    share are read again alone. Marks `found`; returns how many keys failed (not missing)."""
    failed = 0
    step = max(1, slot.size // MIN_SHARE)
    for start in range(0, len(names), step):
        group = list(range(start, min(start + step, len(names))))
        share = slot.size // len(group)
        codes = client.batch_get_into(
            [names[i] for i in group], [slot.addr + j * share for j in range(len(group))], [share] * len(group)
        )
        again = []
        with guard.live() as live:
            if not live:
                return failed
            for j, (i, code) in enumerate(zip(group, codes)):
                if code > 0:
                    sink(i, slot.view[j * share : j * share + code])
                    found[i] = True
                elif code == INVALID:
                    again.append(i)
                else:
                    failed += outage(code)
        for i in again:
            failed += _fetch_alone(client, slot, guard, names[i], sink, found, i)
    return failed


def _fetch_alone(client: Any, slot: Slot, guard: Guard, name: str, sink: ReadSink, found: list[bool], i: int) -> int:
    """One value into the whole slot, or, larger than a slot, by plain get (through the client's
    local buffer). Plain get says b'' for a miss and a failure alike: is_exist tells which."""
    code = client.get_into(name, slot.addr, slot.size)
    data: memoryview | None = slot.view[:code] if code > 0 else None
    if code == INVALID:
        raw = client.get(name)
        if not raw:
            return int(client.is_exist(name) != 0)
        data = memoryview(raw)
    if data is None:
        return int(outage(code))
    with guard.live() as live:
        if live:
            sink(i, data)
            found[i] = True
    return 0


def store(client: Any, slot: Slot, guard: Guard, names: Sequence[str], values: Sequence[Value]) -> list[int]:
    """Upsert values: packed into the slot, each full slot sent with one batch_upsert_from; a
    value larger than the slot by plain upsert. Returns a code per key (0 = stored); an empty
    value is not sent (Mooncake stores no empty objects) and keeps INVALID."""
    codes = [INVALID] * len(names)
    batch: list[tuple[int, int, int]] = []  # (index, offset in slot, size)

    def send() -> None:
        got = client.batch_upsert_from(
            [names[i] for i, _, _ in batch], [slot.addr + off for _, off, _ in batch], [n for _, _, n in batch]
        )
        for (i, _, _), code in zip(batch, got):
            codes[i] = code
        batch.clear()

    used = 0
    for i, value in enumerate(values):
        view = memoryview(value).cast("B")
        if len(view) == 0:
            continue
        if len(view) > slot.size:
            with guard.live() as live:
                data = bytes(view) if live else None  # copied while the caller still owns it
            if data is None:
                return codes
            codes[i] = client.upsert(names[i], data)
            continue
        if used + len(view) > slot.size:
            send()
            used = 0
        with guard.live() as live:
            if not live:
                return codes
            slot.view[used : used + len(view)] = view
        batch.append((i, used, len(view)))
        used += len(view)
    if batch:
        send()
    return codes
