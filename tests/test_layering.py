"""No module reaches into another's private names: each module is used through its public face, so a
module's internals can change without breaking another (issue 26: the seams where defects came from)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(p for d in ("agentstate", "backends", "adapters") for p in (ROOT / d).rglob("*.py"))
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_names(tree: ast.AST) -> set[str]:
    """The private names a module defines itself: functions, classes, `self._x` / `cls._x`, globals."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
    return {n for n in own if _private(n)}


def _libraries(tree: ast.AST) -> set[str]:
    """Names bound to modules of other projects (`import lmdb`): their privates are theirs to judge."""
    return {
        (a.asname or a.name).partition(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
        for a in node.names if not a.name.startswith("agentstate")
    }  # fmt: skip


def _reaches(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    own, libraries = _own_names(tree), _libraries(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("agentstate"):
            found += [f"imports {node.module}.{a.name}" for a in node.names if _private(a.name) and a.name != "_version"]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own | NAMEDTUPLE_API:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", *libraries)):
                found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    reaches = {p.relative_to(ROOT).as_posix(): r for p in MODULES if (r := _reaches(p))}
    assert reaches == {}


def test_state_store_is_composed_and_offers_every_session_operation() -> None:
    """StateStore has its parts (issue 26, room 7): no base class, and each public method of Sessions is
    offered with the same signature and docstring."""
    import inspect

    from agentstate.sessions import Sessions
    from agentstate.store import StateStore

    assert StateStore.__bases__ == (object,)
    assert inspect.signature(StateStore.__init__).parameters.keys() == {"self", "config", "spec", "read_only"}
    offered = {n for n, f in inspect.getmembers(Sessions, inspect.isfunction) if not n.startswith("_")} - {"apply_hint"}
    for name in offered:
        mine, theirs = getattr(StateStore, name), getattr(Sessions, name)
        assert inspect.signature(mine) == inspect.signature(theirs) and mine.__doc__ == theirs.__doc__, name
