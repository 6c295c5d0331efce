"""What ships: the design card's layout under one import name (agentstate, agentstate.backends,
agentstate.adapters), py.typed, the license, one version, and an SDK that imports without torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from agentstate._version import __version__

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (built,) = out.glob("agentstate_kv-*.whl")
    return built


def test_wheel_holds_only_the_agentstate_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"agentstate", next(t for t in tops if t.endswith(".dist-info"))}
    for module in ("agentstate/store.py", "agentstate/backends/lmdb.py", "agentstate/backends/host.py", "agentstate/adapters/__init__.py"):
        assert module in names
    # every module of the checkout ships: a subpackage missing from pyproject's list breaks a real install
    sources = {f"agentstate/{p.relative_to(ROOT / 'agentstate')}" for p in (ROOT / "agentstate").rglob("*.py")}
    for folder in ("backends", "adapters"):  # and their subpackages (agentstate.adapters.vllm)
        sources |= {f"agentstate/{folder}/{p.relative_to(ROOT / folder)}" for p in (ROOT / folder).rglob("*.py")}
    assert sources - set(names) == set()


WHERE = """
import importlib, json, sys
import agentstate, agentstate.backends.lmdb as m, agentstate.adapters.vllm.blocks as v
try:
    importlib.import_module("agentstate.agentstate")
    second = True
except ModuleNotFoundError:
    second = False
print(json.dumps({"path": list(agentstate.__path__), "lmdb": m.__file__, "blocks": v.__file__, "second": second}))
"""
"""Where the package and its mapped folders import from, and whether a second copy of it resolves."""


def _where(python: str | Path, cwd: Path, *args: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(python), *args, WHERE], cwd=cwd, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("where", ["repo root", "elsewhere"])
def test_checkout_imports_resolve_to_the_same_files_and_no_second_copy(where: str, tmp_path: Path) -> None:
    """From the repo root (where ./agentstate is first on sys.path) and from any other directory (the
    editable install's finder), the same files; `agentstate.agentstate` is no name at all."""
    assert _where(sys.executable, ROOT if where == "repo root" else tmp_path, "-c") == {
        "path": [str(ROOT / "agentstate")], "lmdb": str(ROOT / "backends" / "lmdb.py"),
        "blocks": str(ROOT / "adapters" / "vllm" / "blocks.py"), "second": False,
    }  # fmt: skip


def test_python_m_pytest_from_the_root_imports_the_checkout(tmp_path: Path) -> None:
    """`python -m pytest` puts the repo root first on sys.path: the mapped folders still resolve."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(f"def test_probe():\n    exec({WHERE!r})\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:xdist", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(probe)], cwd=ROOT, capture_output=True, text=True,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(t for t in done.stdout.splitlines() if t.lstrip(".").startswith("{"))
    found = json.loads(line.lstrip("."))
    assert found["lmdb"] == str(ROOT / "backends" / "lmdb.py") and found["second"] is False


def test_the_built_wheel_installed_in_a_fresh_venv_imports_the_mapped_folders(wheel: Path, tmp_path: Path) -> None:
    """The wheel alone, installed where the checkout is out of sight: its dependencies come from this
    interpreter's site-packages through a .pth line (which runs none of their .pth files, so this
    checkout's editable finder stays out), and it is run from another directory."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, timeout=300)  # fmt: skip
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                  check=True, capture_output=True, text=True).stdout.strip())  # fmt: skip
    deps = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    (purelib / "deps.pth").write_text("\n".join(deps) + "\n")
    installed = purelib / "agentstate"
    assert _where(python, tmp_path, "-c") == {
        "path": [str(installed)], "lmdb": str(installed / "backends" / "lmdb.py"),
        "blocks": str(installed / "adapters" / "vllm" / "blocks.py"), "second": False,
    }  # fmt: skip


def test_wheel_ships_types_license_and_one_version(wheel: Path) -> None:
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    assert "agentstate/py.typed" in names
    dist = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert dist == f"agentstate_kv-{__version__}.dist-info"
    licenses = [n for n in names if n.startswith(f"{dist}/licenses/")]
    assert licenses == [f"{dist}/licenses/LICENSE"]
    text = archive.read(licenses[0]).decode()
    assert text.startswith("Copyright 2026 the agentstate authors") and "Apache License" in text
    meta = Parser().parsestr(archive.read(f"{dist}/METADATA").decode())
    assert meta["Version"] == __version__ and meta["License-Expression"] == "Apache-2.0"
    assert meta["Name"] == "agentstate-kv"  # the name `agentstate` on PyPI is another project's
    client = [r for r in meta.get_all("Requires-Dist", []) if re.search(r"extra\s*==\s*[\"']client[\"']", r)]
    assert [r.split(";")[0].strip() for r in client] == ["httpx>=0.27"]


HEAVY = ("torch", "numpy", "lmdb", "transformers", "fastapi", "uvicorn", "redis")
"""What `pip install 'agentstate-kv[client]'` must not bring: the SDK is httpx, pydantic and xxhash."""


def _requires(wheel: Path) -> dict[str | None, list[str]]:
    """The wheel's Requires-Dist by extra (None: the core), names only."""
    archive = zipfile.ZipFile(wheel)
    meta_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(archive.read(meta_name).decode())
    out: dict[str | None, list[str]] = {}
    for req in meta.get_all("Requires-Dist", []):
        spec, _, marker = req.partition(";")
        extra = re.search(r"extra\s*==\s*[\"']([\w-]+)[\"']", marker)
        out.setdefault(extra.group(1) if extra else None, []).append(re.split(r"[\s\[<>=!~;]", spec.strip())[0].lower())
    return out


def test_the_client_extra_installs_no_torch_and_every_engine_side_extra_brings_the_store(wheel: Path) -> None:
    requires = _requires(wheel)
    for name in HEAVY:
        assert name not in requires[None] + requires["client"], f"agentstate-kv[client] would install {name}"
    assert sorted(requires["store"]) == ["lmdb", "numpy", "torch"]
    for extra, names in requires.items():
        if extra not in (None, "client", "yaml", "store"):
            assert "agentstate-kv" in names, f"agentstate-kv[{extra}] does not bring agentstate-kv[store]"


def test_the_version_is_written_once() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]$', pyproject, re.MULTILINE)
    assert 'version = { attr = "agentstate._version.__version__" }' in pyproject
    written = [
        p.relative_to(ROOT).as_posix() for p in [*(ROOT / "agentstate").rglob("*.py"), ROOT / "pyproject.toml"]
        if re.search(rf"""version\w*\s*[=:]\s*["']{re.escape(__version__)}["']""", p.read_text())
    ]  # fmt: skip
    assert written == ["agentstate/_version.py"]
    out = subprocess.run([sys.executable, "-m", "agentstate", "version"], cwd=ROOT, capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.strip() == __version__


# Imports the modules in argv with torch (and numpy, lmdb, the service's packages) unimportable, as in
# an environment where only `agentstate-kv[client]`'s httpx and pydantic were installed.
NO_TORCH = """
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "numpy", "lmdb", "fastapi", "starlette", "uvicorn"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, Blocked())
import importlib
for module in sys.argv[1:]:
    importlib.import_module(module)
"""


def _import_without_torch(*modules: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH, *modules], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_package_and_cli_import_without_torch() -> None:
    done = _import_without_torch("agentstate", "agentstate.errors", "agentstate._version", "agentstate.cli")
    assert done.returncode == 0, done.stderr


def test_sdk_imports_without_torch() -> None:
    done = _import_without_torch("agentstate.client", "agentstate.wire", "agentstate.ops", "agentstate.ops.reports")
    assert done.returncode == 0, done.stderr
