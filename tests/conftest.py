from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import torch

try:
    import agentstate.backends  # noqa: F401
except ModuleNotFoundError as exc:  # a checkout that was never installed: nothing maps the folder
    raise ImportError("agentstate.backends and agentstate.adapters are the checkout's backends/ and adapters/, "
                      "mapped by packaging alone: install the checkout first (pip install -e '.[test]')") from exc

from agentstate import ModelSpec, StateStore
from tests.mooncake_server import MooncakeServer
from tests.redis_server import RedisCluster, RedisServer
from tests.requires import in_ci

SPEC4 = ModelSpec(model_id="test/tiny", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")
SPEC32 = ModelSpec(model_id="test/llama-8b-shape", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def random_kv(spec: ModelSpec, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Canonical KV of arbitrary bit patterns (NaNs and infs included): bit-exactness is about bytes."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*spec.kv_shape(num_tokens)[:-1], spec.head_dim * spec.torch_dtype.itemsize),
                        dtype=torch.uint8, generator=g)  # fmt: skip
    return raw.view(spec.torch_dtype)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))


def random_tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed + 1_000_003)
    return torch.randint(0, 150_000, (n,), generator=g).tolist()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def mooncake_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeServer]:
    """A Mooncake master and one storage process on loopback (skips where mooncake cannot run)."""
    server = MooncakeServer(tmp_path_factory.mktemp("mooncake")).start()
    yield server
    server.stop()


@pytest.fixture
def spec() -> ModelSpec:
    return SPEC4


@pytest.fixture
def open_store(tmp_path: Path) -> Callable[..., object]:
    """Open a StateStore on the test's data directory (same directory on every call)."""

    def factory(spec: ModelSpec = SPEC4, **overrides: object):  # type: ignore[no-untyped-def]
        overrides.setdefault("chunk_tokens", 64)
        overrides.setdefault("lmdb_map_size", 64 << 20)
        return StateStore.open(tmp_path / "data", spec, **overrides)

    return factory


@pytest.fixture
async def store(open_store: Callable[..., object]) -> AsyncIterator[StateStore]:
    async with open_store() as s:  # type: ignore[attr-defined]
        yield s


FIRST = ("test_sglang_server.py",)
"""Modules that take longest (real SGLang servers: ~10 min on two cores), collected first, so that under
pytest-xdist (.ci/run) one worker starts them while the other works through the rest."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _ci_refuses(report: pytest.TestReport | pytest.CollectReport, what: str) -> None:
    """In CI a skip is a failure (tests/requires.py): everything the tests need is installed there,
    so a skip means a broken install or environment. gpu tests without CUDA are not passed here."""
    if not report.skipped or hasattr(report, "wasxfail") or not in_ci():
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"{what} skipped in CI (CI={os.environ.get('CI')}), which CI does not allow: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    if not ("gpu" in item.keywords and not torch.cuda.is_available()):  # the one skip CI keeps
        _ci_refuses(outcome.get_result(), item.nodeid)  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _ci_refuses(outcome.get_result(), collector.nodeid)  # type: ignore[attr-defined]
