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
