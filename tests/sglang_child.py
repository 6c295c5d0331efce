"""The start of a child script that imports SGLang's classes in a fresh interpreter (tests that check
SGLang's pools and metrics through its own storage factory, in a process of their own)."""

TORCHVISION_PLACEHOLDER = r"""
import importlib.abc, importlib.machinery, json, sys, types
try:
    import torchvision  # noqa: F401
except Exception:  # only a CUDA torchvision exists on PyPI: SGLang's config registry imports it for images
    import transformers.utils.import_utils  # noqa: F401  (decides torchvision availability before the placeholder)
    sys.modules.pop("torchvision", None)
    class Placeholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.split(".")[0] == "torchvision" else None
        def create_module(self, spec):
            module = types.ModuleType(spec.name); module.__path__ = []; module.__getattr__ = lambda n: object
            return module
        def exec_module(self, module): pass
    sys.meta_path.insert(0, Placeholder())
"""
"""PyPI has only a CUDA torchvision, which fails to import beside the CPU torch, and SGLang's config
registry imports it (for images): where it does not import, an empty placeholder package stands in.
transformers decides torchvision's availability on import, so it is imported before the placeholder."""


def run_child(script: str, *args: str) -> dict:
    """Run `script` (it starts with TORCHVISION_PLACEHOLDER) in a fresh interpreter with this checkout on
    its path, and return the JSON of its last line, `RESULT {...}`. A child that prints `SKIP "<module>"`
    (an SGLang module it imports is missing) skips the test, or fails it in CI."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.requires import skip_or_fail

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", script, *args], check=False, cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    lines = proc.stdout.splitlines()
    if lines and lines[-1].startswith("SKIP "):
        skip_or_fail(f"SGLang's host pool module needs {json.loads(lines[-1][5:])!r} (not in requirements-sglang.txt)")
    assert proc.returncode == 0 and lines and lines[-1].startswith("RESULT "), proc.stderr[-4000:]
    return dict(json.loads(lines[-1][7:]))
