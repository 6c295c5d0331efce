"""The design card's layout installs under one import name: agentstate, agentstate.backends, agentstate.adapters."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_holds_only_the_agentstate_package(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("agentstate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"agentstate", next(t for t in tops if t.endswith(".dist-info"))}
    for module in ("agentstate/store.py", "agentstate/backends/lmdb.py", "agentstate/backends/host.py", "agentstate/adapters/__init__.py"):
        assert module in names
    # every module of the checkout ships: a subpackage missing from pyproject's list breaks a real install
    sources = {f"agentstate/{p.relative_to(ROOT / 'agentstate')}" for p in (ROOT / "agentstate").rglob("*.py")}
    sources |= {f"agentstate/{d}/{p.name}" for d in ("backends", "adapters") for p in (ROOT / d).glob("*.py")}
    assert sources - set(names) == set()


def test_checkout_imports_resolve_to_the_same_files() -> None:
    code = "import agentstate.backends.lmdb as m, agentstate.adapters as a; print(m.__file__); print(a.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(ROOT / "backends" / "lmdb.py"), str(ROOT / "adapters" / "__init__.py")]
