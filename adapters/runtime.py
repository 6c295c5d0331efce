"""What every engine adapter needs and no engine defines: its settings, a loop thread, a never-raise guard.

An engine calls an adapter from its own threads, synchronously, and must never see an exception
from it (a failed store is a miss, never a failed request); the store is asyncio. So each adapter
runs one private event loop in a daemon thread (`LoopThread`), guards every engine-facing method
(`never_raises`), and reads its own keys of the engine's extra config into an `AdapterSettings`
subclass that names its config-file table (`[sglang]`, `[vllm]`). Nothing here imports an engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from typing_extensions import Self

from agentstate.errors import BackendError, InvalidArgumentError
from agentstate.settings import adapter_keys, problems

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class AdapterSettings(BaseModel):
    """An adapter's own keys of its engine's extra config; all other keys (`tiers`,
    `host_capacity_bytes`, `write_policy`, ...) go to `StoreConfig` unchanged.

    `config_file` (else env AGENTSTATE_CONFIG_FILE) adds a config file (docs/config.md): its
    StoreConfig keys under the env vars, under the inline keys; its table named `table` holds these
    keys, under the inline ones; its `path` is the data root unless one is given here. A subclass
    names its `table` and the `engine_keys` its engine puts in the same dict for itself."""

    model_config = ConfigDict(extra="forbid")
    table: ClassVar[str] = "adapter"
    engine_keys: ClassVar[frozenset[str]] = frozenset()

    path: Path = Field(default=Path("agentstate"), description="data root; one directory per rank below it")
    model_id: str | None = Field(default=None, description="overrides the engine's model name in the fingerprint")
    revision: str = Field(default="main", description="model revision in the fingerprint")
    timeout_s: float = Field(default=60.0, gt=0, description="longest one engine call waits for the store")
    config_file: Path | None = Field(
        default=None, description="config file (TOML, YAML, JSON) under env vars and inline keys; default: env"
        " AGENTSTATE_CONFIG_FILE",
    )  # fmt: skip

    @classmethod
    def split(cls, extra: dict[str, Any]) -> tuple[Self, dict[str, Any]]:
        """(adapter settings, StoreConfig overrides) from an engine's extra config dict, its config
        file folded in; a bad key or value is InvalidArgumentError."""
        own = {k: v for k, v in extra.items() if k in cls.model_fields}
        rest = {k: v for k, v in extra.items() if k not in cls.model_fields and k not in cls.engine_keys}
        own, rest = adapter_keys(cls.table, own, rest)
        try:
            return cls(**own), rest
        except ValidationError as exc:
            raise InvalidArgumentError(f"agentstate {cls.table} adapter settings: {problems(exc)}") from None


def never_raises(fallback: Callable[..., Any]) -> Callable[[F], F]:
    """Turn any exception of an engine-facing method into `self._failed(...)` and a `fallback(*args)` answer."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the point: nothing may escape into the engine's threads
                self._failed(fn.__name__, exc)
                return fallback(*args, **kwargs)

        return cast(F, guarded)

    return wrap


class LoopThread:
    """One private asyncio loop in a daemon thread: the sync facade the engine's threads call."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self.closed = False

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the loop; raises TimeoutError (after cancelling it) past `timeout` seconds."""
        if self.closed or threading.current_thread() is self._thread:
            coro.close()
            raise BackendError("the agentstate loop is closed (or called from itself)")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"agentstate call took longer than {timeout} s") from None

    def stop(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
