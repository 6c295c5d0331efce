"""A real SGLang server on CPU, for tests: `python tests/sglang_launch.py <sglang.launch_server args>`.

SGLang 0.5.23 serves on CPU only with a few pieces its CUDA-only parts lack (shared/notes/sglang-cpu.md).
They stand in here, in this process and in the processes SGLang spawns from it (a spawned child runs
this file again as `__mp_main__`, so everything above `main()` is applied there too), never in the
agentstate package. Each hooks a private SGLang name: re-check them on every SGLang upgrade.

- `SGLANG_USE_CPU_ENGINE=1`: what `--device cpu` needs (without it startup imports vLLM).
- `sgl_kernel`: no CPU build exists on PyPI. A stand-in package that registers no `torch.ops.sgl_kernel`
  ops (so SGLang's AMX paths stay off and every layer runs its pure-torch `forward_native`), with a
  pure-torch `assign_req_to_token_pool_cpu` (used on every prefill); any other name is a stub that
  raises, naming itself, if it is ever called.
- `torchvision`: PyPI has only CUDA builds. SGLang's config registry imports `torchvision.transforms`
  for image models at module level; an empty placeholder package stands in when none imports.
- HiCache host pool on device `cpu`: allocated unpinned (SGLang would call CUDA host registration),
  `pin_memory` False after construction (the L3 prefetch path allocates with it), and pure-torch index
  copies for the `direct` io backend's transfer ops, which SGLang binds only for CUDA/ROCm/XPU/NPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any

import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


# -- import placeholders ---------------------------------------------------------------------------


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:  # fmt: skip
    """sgl_kernel's op: request i's slots start_offset[i]:end_offset[i] take the next run of out_cache_loc."""
    del pool_len
    offset = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _missing(name: str) -> Any:
    def stub(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU stand-in (tests/sglang_launch.py)")

    stub.__name__ = name
    return stub


class _Placeholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty packages for `torchvision.*` (any attribute: `object`) and for `sgl_kernel` (any name: a stub that
    raises when called; its submodules do not import)."""

    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        root = name.split(".")[0]
        if root not in self.roots:
            return None
        if root == "sgl_kernel" and name != root:  # sgl_kernel.*: missing, so SGLang's ImportError fallbacks apply
            raise ModuleNotFoundError(f"No module named {name!r} (sgl_kernel stand-in)", name=name)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        if spec.name.split(".")[0] == "sgl_kernel":
            module.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu  # type: ignore[attr-defined]

            def getattr_(attr: str) -> Any:
                if attr.startswith("__"):
                    raise AttributeError(attr)
                return _missing(attr)
        else:

            def getattr_(attr: str) -> Any:
                if attr.startswith("__"):
                    raise AttributeError(attr)
                return object

        module.__getattr__ = getattr_  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _install_placeholders() -> None:
    roots = set()
    try:
        import sgl_kernel  # noqa: F401
    except ImportError:
        roots.add("sgl_kernel")
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - a CUDA build fails with RuntimeError, not ImportError
        import transformers.utils.import_utils  # noqa: F401  (decides torchvision is unavailable first)

        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        roots.add("torchvision")
    if roots:
        sys.meta_path.insert(0, _Placeholders(roots))


# -- HiCache host pool on cpu ----------------------------------------------------------------------


def _alloc_unpinned(dims: tuple, dtype: torch.dtype, device: str, pin_memory: bool, allocator: Any,
                    registration_granularity_bytes: int | None = None) -> torch.Tensor:  # fmt: skip
    del pin_memory, registration_granularity_bytes
    if allocator is not None and hasattr(allocator, "allocate"):
        return allocator.allocate(dims, dtype=dtype, device=device)
    return torch.empty(dims, dtype=dtype, device=device)


def _pages(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """First token slot of each page in a run of whole pages."""
    return indices.reshape(-1, page_size)[:, 0].long()


def transfer_kv_direct(src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor], src_indices: torch.Tensor,
                       dst_indices: torch.Tensor, page_size: int) -> None:  # fmt: skip
    """Token-major layer buffers [slots, ...]: dst[dst_indices] = src[src_indices], layer by layer."""
    del page_size
    src, dst = src_indices.long(), dst_indices.long()
    for s, d in zip(src_layers, dst_layers):
        d[dst] = s[src].to(d.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: list[torch.Tensor], dst_ptrs: list[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                       page_size: int) -> None:  # fmt: skip
    """Device layers (K layers, then V layers; [slots, heads, dim]) into host page_first_direct buffers
    [pages, layers, page_size, heads, dim] (one buffer for MLA, K and V for MHA)."""
    planes = len(dst_ptrs)
    layers = len(src_ptrs) // planes
    src = src_indices.long()
    dst_pages = _pages(dst_indices, page_size) // page_size
    for p, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            rows = src_ptrs[p * layers + layer][src]
            dst[dst_pages, layer] = rows.reshape(len(dst_pages), page_size, *rows.shape[1:]).to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: list[torch.Tensor], dst_ptrs: list[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor, layer_id: int,
                                       page_size: int) -> None:  # fmt: skip
    """One layer of host page_first_direct buffers into device layer buffers [slots, heads, dim]."""
    src_pages = _pages(src_indices, page_size) // page_size
    dst = dst_indices.long()
    for s, d in zip(src_ptrs, dst_ptrs):
        rows = s[src_pages, layer_id]  # [pages, page_size, heads, dim]
        d[dst] = rows.reshape(-1, *rows.shape[2:]).to(d.device)


def _patch_host_pools() -> None:
    from sglang.srt.mem_cache.pool_host import base, common, mha

    common.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_unpinned
    init = base.HostKVCache.__init__

    def init_unpinned(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.pin_memory = False  # get_dummy_flat_data_page would ask for pinned memory

    base.HostKVCache.__init__ = init_unpinned  # type: ignore[method-assign]
    for fn in (transfer_kv_direct, transfer_kv_all_layer_direct_lf_pf, transfer_kv_per_layer_direct_pf_lf):
        if not hasattr(mha, fn.__name__):  # bound only on CUDA/ROCm/XPU/NPU
            setattr(mha, fn.__name__, fn)


_install_placeholders()
_patch_host_pools()


def main() -> None:
    """`python -m sglang.launch_server`'s own body, run from here: this file stays `__main__`, so the
    processes SGLang spawns run it again (as `__mp_main__`) and get the stand-ins too."""
    from sglang.launch_server import load_plugins, prepare_server_args, run_server
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sys.argv[1:])
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
