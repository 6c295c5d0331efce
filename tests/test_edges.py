"""A core that names no engine (issue 26, room 4): adapters declare their config-file tables and the
keys they store outside the catalog (`agentstate.edges`), and the core (settings, keys, the operator
tools, the CLI) reads the declarations. Tested with an edge defined here, as one outside the
repository would be."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentstate import codec, edges
from agentstate.errors import InvalidArgumentError
from agentstate.ops.admin import stats
from agentstate.ops.verify import verify
from agentstate.settings import read_config_file
from agentstate.spec import ModelSpec
from agentstate.store import StateStore

ROOT = Path(__file__).resolve().parent.parent
CORE = ["agentstate/settings.py", "agentstate/keys.py", "agentstate/ops/admin.py", "agentstate/ops/verify.py",
        "agentstate/cli.py", "agentstate/edges.py"]  # fmt: skip
SPEC = ModelSpec(model_id="edge-test", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8)
TOY = edges.KeySpace("z/", report="toy_pages", label="toy engine pages")


@pytest.fixture
def toy() -> Iterator[edges.Edge]:
    """An engine adapter from outside the repository: a config table and pages of its own."""
    edge = edges.declare(edges.Edge("toy", key_spaces=(TOY,)))
    try:
        yield edge
    finally:
        edges.withdraw("toy")


def test_the_core_names_no_engine() -> None:
    for name in CORE:
        text = (ROOT / name).read_text()
        assert not re.search(r"sglang|vllm", text, re.IGNORECASE), name


def test_the_shipped_adapters_declare_their_tables_and_pages() -> None:
    assert {"sglang", "vllm"} <= set(edges.tables())
    assert [s.prefix for s in edges.key_spaces() if s.report == "sglang_pages"] == ["p/"]


def test_a_declared_table_is_read_and_an_undeclared_one_refused(tmp_path: Path, toy: edges.Edge) -> None:
    file = tmp_path / "engine.toml"
    file.write_text('chunk_tokens = 64\n[toy]\npath = "kv"\ntimeout_s = 3\n')
    read = read_config_file(file)
    assert read.adapters["toy"] == {"path": str(tmp_path / "kv"), "timeout_s": 3}  # relative to the file
    assert read.store == {"chunk_tokens": 64}
    file.write_text("[other]\nx = 1\n")
    with pytest.raises(InvalidArgumentError, match="other"):
        read_config_file(file)


def test_key_spaces_never_overlap(toy: edges.Edge) -> None:
    for prefix in ("c/", "t/", "p/", "z/", "z"):
        with pytest.raises(InvalidArgumentError, match="overlaps"):
            edges.declare(edges.Edge("clash", key_spaces=(edges.KeySpace(prefix, report="x", label="x"),)))
    assert "clash" not in edges.tables()
    edges.declare(edges.Edge("toy", key_spaces=(TOY,)))  # declaring again replaces, never clashes with itself


async def test_pages_of_a_declared_key_space_are_verified_and_counted(tmp_path: Path, toy: edges.Edge) -> None:
    """Pages no manifest names: verify checks them with the codec (a damaged one is corrupt), never as
    orphans or missing; stats counts them under the field the adapter named."""
    import torch

    keys = [f"z/{SPEC.fingerprint}/page-{i}" for i in range(3)]
    async with StateStore.open(tmp_path / "data", SPEC) as store:
        values = [bytes(codec.encode(torch.full((2, 2, 4, 2, 8), float(i)), SPEC.fingerprint, key=k))
                  for i, k in enumerate(keys)]  # fmt: skip
        with store.chunks.pinned(keys):
            await store.chunks.put_values(keys, values, durable=True)
        report = await stats(store)
        assert (report.model_extra or {})["toy_pages"] == 3
        checked = await verify(store)
        record = next(t for t in checked.tiers if t.tier == store.chunks.record_tier)
        assert checked.clean and record.pages == 3 and record.ok == 3 and not checked.orphans
        moved = f"z/{SPEC.fingerprint}/page-moved"  # a valid page stored under another key: corrupt
        with store.chunks.pinned([moved]):
            await store.chunks.put_values([moved], [values[1]], durable=True)
        checked = await verify(store)
        assert not checked.clean and [b.key for b in checked.corrupt if b.tier == store.chunks.record_tier] == [moved]
