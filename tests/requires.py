"""What a test needs that may be missing: skipped with the reason on a developer's machine, a loud
failure in CI (env CI=true or 1, as `.ci/run` sets it), where everything the tests use is installed
and a skip would hide a broken install.

Use these instead of `pytest.importorskip` / `pytest.skip` for optional engines (SGLang, vLLM) and
test infrastructure (redis-server, Mooncake, the `agentstate` command). Skips that stay skips
everywhere: `gpu`-marked tests without CUDA (tests/conftest.py). tests/conftest.py also turns any
other skip in CI into a failure, so a skip added without these helpers cannot hide either.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest


def in_ci() -> bool:
    """True when the env var CI is "true" or "1" (any case)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def skip_or_fail(reason: str) -> NoReturn:
    """Skip with `reason`, or fail with it in CI. Works in a test, a fixture or at module level."""
    if in_ci():
        pytest.fail(f"{reason} [CI={os.environ.get('CI')}: a missing requirement fails in CI instead of skipping]",
                    pytrace=False)  # fmt: skip
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str, hint: str = "") -> ModuleType:
    """`pytest.importorskip(name)` that fails in CI: the module, or a skip/failure saying why it did not import."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        error = f"{type(exc).__name__}: {exc}"
    skip_or_fail(f"{name} does not import ({error})" + (f"; {hint}" if hint else ""))
