"""Backend registry: a tier's config -> its backend, built by the module the backend lives in.

Each kind's config model names its backend's module (`TierConfig.backend_module`, e.g.
`agentstate.backends.host`), and that module's `from_config(cfg, store)` builds it: the module is
imported only when a tier of its kind is opened, so `import agentstate` never needs redis,
mooncake or CUDA. A backend outside the repository is a tier whose `kind` is its own and whose
`module_path` names its module: a dotted name on `sys.path`, or a `.py` file (absolute, or relative
to the current directory). A tier with `compression` set is its backend wrapped in a
CompressedBackend (the codec is imported only then, so zstandard and lz4 are needed only by tiers
that use them).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from agentstate.backends.base import Backend
from agentstate.config import ExternalTier, StoreConfig, TierConfig
from agentstate.errors import InvalidArgumentError


def backend_module(cfg: TierConfig) -> ModuleType:
    """The module that builds `cfg`'s backend, imported now (once per process)."""
    path = cfg.module_path if isinstance(cfg, ExternalTier) else cfg.backend_module
    if not path:
        raise InvalidArgumentError(f"tier {cfg.tier_name!r}: kind {cfg.kind!r} names no backend module")
    try:
        if path.endswith(".py"):
            return _load_file(Path(path))
        return importlib.import_module(path)
    except ImportError as exc:
        raise InvalidArgumentError(f"tier {cfg.tier_name!r}: cannot import its backend {path!r} ({exc})") from exc


def _load_file(path: Path) -> ModuleType:
    """A backend module given as a file: loaded once, under a name made from its resolved path."""
    path = path.resolve()
    if not path.is_file():
        raise ImportError(f"no file {path}")
    name = f"agentstate_backend_{path.stem}_{hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def build_backend(cfg: TierConfig, store: StoreConfig) -> Backend:
    module = backend_module(cfg)
    factory = getattr(module, "from_config", None)
    if not callable(factory):
        raise InvalidArgumentError(f"tier {cfg.tier_name!r}: {module.__name__} has no from_config(cfg, store)")
    backend = factory(cfg, store)
    if not isinstance(backend, Backend):
        raise InvalidArgumentError(
            f"tier {cfg.tier_name!r}: {module.__name__}.from_config returned {type(backend).__name__}, not a Backend"
        )
    if cfg.compression != "none":
        from agentstate.backends.compressed import CompressedBackend

        backend = CompressedBackend(backend, cfg.compression, threads=store.io_threads)
    backend.name = cfg.tier_name
    return backend
