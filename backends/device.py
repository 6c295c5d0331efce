"""Device tier: encoded chunks kept in a torch device's memory (a GPU, or `cpu` here).

The top of the hierarchy: chunks promoted here are served to targets on the same device. Each
value is one uint8 tensor holding the encoded bytes. On `cpu` reads hand out views of that
memory (no copy); on CUDA `read` copies to host first, the path used for demotion and for
targets on other devices.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from agentstate.backends.base import Backend, BackendStats, InMemory, ReadSink, io_pool

if TYPE_CHECKING:
    from agentstate.config import DeviceTier, StoreConfig


class DeviceBackend(InMemory, Backend):
    name = "device"
    durable = False
    trusted = True

    @staticmethod
    def _size(value: torch.Tensor) -> int:
        return value.numel()

    def __init__(self, device: str | torch.device = "cpu", *, threads: int = 2) -> None:
        self.device = torch.device(device)
        self._items: dict[str, torch.Tensor] = {}
        self._used = 0
        self._pool = io_pool(threads, "agentstate-device")
        self._counts: Counter[str] = Counter()

    def _host_view(self, value: torch.Tensor) -> memoryview:
        host = value if value.device.type == "cpu" else value.cpu()
        return memoryview(host.numpy())  # type: ignore[arg-type]

    async def read(self, keys: Sequence[str], sink: ReadSink) -> list[bool]:
        values = [self._items.get(k) for k in keys]

        def run() -> None:
            for i, value in enumerate(values):
                if value is not None:
                    sink(i, self._host_view(value))

        await asyncio.get_running_loop().run_in_executor(self._pool, run)
        hits = sum(v is not None for v in values)
        self._counts.update(reads=hits, misses=len(values) - hits)
        return [v is not None for v in values]

    async def put(self, keys: Sequence[str], values: Sequence[bytes | bytearray | memoryview]) -> None:
        def run() -> list[torch.Tensor]:
            out = []
            for value in values:
                host = torch.frombuffer(value, dtype=torch.uint8) if len(value) else torch.empty(0, dtype=torch.uint8)
                out.append(host.to(self.device, copy=True))
            return out

        tensors = await asyncio.get_running_loop().run_in_executor(self._pool, run)
        for key, tensor in zip(keys, tensors):
            if key not in self._items:
                self._items[key] = tensor
                self._used += tensor.numel()
                self._counts["writes"] += 1

    async def stats(self) -> BackendStats:
        return BackendStats(
            name=self.name, items=len(self._items), bytes_used=self._used, capacity_bytes=None,
            **{k: self._counts[k] for k in ("reads", "writes", "deletes", "misses", "errors")},
        )  # fmt: skip

    async def close(self) -> None:
        self._items.clear()
        self._used = 0
        self._pool.shutdown(wait=True)


def from_config(cfg: DeviceTier, store: StoreConfig) -> DeviceBackend:
    """The device tier of a store, on `cfg.device`."""
    return DeviceBackend(cfg.device)
