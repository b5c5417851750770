"""The package walls hold: the core (`areal_service`) imports none of its peers, the peers
(`engine`, `gateway`, `trainer`) import only the core, `launcher` sits on top, and no two
modules import each other in a circle. Imports inside functions count too: a lazy import
is still an arrow. Inside the core, SQL stays in the store package, whose domains
(trajectories, keys, coordination) are reached through their objects only."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from areal_service.store import Coordination, KeyStore, PolicyStore, TrajectoryStore

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("areal_service", "engine", "gateway", "trainer", "launcher")
# Which packages each package may import (besides itself).
ALLOWED: dict[str, set[str]] = {
    "areal_service": set(),
    "engine": {"areal_service"},
    "gateway": {"areal_service"},
    "trainer": {"areal_service"},
    "launcher": {"areal_service", "engine", "gateway", "trainer"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            found[_module_name(path)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports, resolved to the longest known module name."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the submodule; `from pkg import name`, the package.
            candidates = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        for candidate in candidates:
            parts = candidate.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts and ".".join(parts) != name:
                targets.add(".".join(parts))
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def test_no_import_from_a_lower_package_to_a_higher_one():
    wrong = sorted(
        f"{source} -> {target}"
        for source, targets in _graph().items()
        for target in targets
        if (top := target.split(".")[0]) != source.split(".")[0]
        and top not in ALLOWED[source.split(".")[0]]
    )
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle():
    # A package importing its own submodules (re-exports in __init__) is not a circle
    # unless a submodule imports the package back; both arrows are in the graph.
    assert not _cycles(_graph())


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.processes
def test_the_core_loads_no_torch_transformers_or_peer():
    code = (
        "import importlib, pkgutil, sys, areal_service, areal_service.store\n"
        "for m in pkgutil.walk_packages(areal_service.__path__, 'areal_service.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch', 'transformers', 'gateway', 'trainer', 'engine', 'launcher', 'fastapi'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == ""


def test_sql_lives_in_the_store():
    """No module outside `areal_service.store` builds SQL or touches an ORM row."""
    wrong = []
    for name, path in _modules().items():
        if name == "areal_service.store" or name.startswith("areal_service.store."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                used = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                used = [node.module]
            else:
                continue
            wrong += [
                f"{name}: {m}"
                for m in used
                if m.split(".")[0] == "sqlalchemy" or m.startswith("areal_service.store.schema")
            ]
    assert not wrong, "\n".join(wrong)


# The store's domains: `TrajectoryStore` (trajectories and their reads), `store.keys`
# (`KeyStore`) and `store.coordination` (`Coordination`). Callers outside the package use
# these objects' methods; the modules whose functions take the engine are theirs alone.


def _outside_the_store() -> dict[str, Path]:
    return {
        name: path
        for name, path in _modules().items()
        if name != "areal_service.store" and not name.startswith("areal_service.store.")
    }


def _public_methods(cls: type) -> set[str]:
    return {
        name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")
    }


def _takes_the_engine(function: object) -> bool:
    """A function with an `Engine` or `Connection` parameter: the store's internal style."""
    if not inspect.isfunction(function):
        return False
    annotations = inspect.signature(function).parameters.values()
    return any(str(p.annotation).split(".")[-1] in ("Engine", "Connection") for p in annotations)


def test_the_store_domains_do_not_overlap():
    trajectories = _public_methods(TrajectoryStore)
    keys, coordination = _public_methods(KeyStore), _public_methods(Coordination)
    policies = _public_methods(PolicyStore)
    assert keys and coordination and policies
    assert not trajectories & (keys | coordination | policies), (
        "a domain's method on TrajectoryStore"
    )
    assert not keys & coordination and not policies & (keys | coordination)


def test_no_function_that_takes_the_engine_is_imported_outside_the_store():
    """Outside the store, store modules give types and objects, never a free function
    over the engine (those are called by their owning object)."""
    wrong = []
    for name, path in _outside_the_store().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "areal_service.store"
            ):
                module = importlib.import_module(node.module or "")
                for alias in node.names:
                    found = getattr(module, alias.name, None)
                    members = (
                        [
                            v
                            for _, v in inspect.getmembers(found, inspect.isfunction)
                            if v.__module__ == found.__name__
                        ]
                        if inspect.ismodule(found)
                        else [found]
                    )
                    wrong += [
                        f"{name}: {node.module}.{alias.name}"
                        for f in members
                        if _takes_the_engine(f)
                    ][:1]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("areal_service.store."):
                        module = importlib.import_module(alias.name)
                        if any(
                            _takes_the_engine(f) and f.__module__ == alias.name
                            for _, f in inspect.getmembers(module, inspect.isfunction)
                        ):
                            wrong.append(f"{name}: import {alias.name}")
    assert not wrong, "\n".join(wrong)


def _store_like(node: ast.expr) -> bool:
    """`store`, `_store`, `x.store` or `x._store`."""
    return (isinstance(node, ast.Name) and node.id in ("store", "_store")) or (
        isinstance(node, ast.Attribute) and node.attr in ("store", "_store")
    )


def test_nothing_outside_the_store_holds_its_engine():
    wrong = [
        f"{name}:{node.lineno}"
        for name, path in _outside_the_store().items()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute) and node.attr == "engine" and _store_like(node.value)
    ]
    assert not wrong, "store.engine outside the store:\n" + "\n".join(wrong)


def _protocol_methods(tree: ast.Module) -> set[str]:
    """Methods of the module's own `Protocol` classes (a module may ask for just the one
    method it calls, which the app fills with the domain's object)."""
    return {
        item.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and any(
            getattr(base, "id", getattr(base, "attr", None)) == "Protocol" for base in node.bases
        )
        for item in node.body
        if isinstance(item, ast.FunctionDef)
    }


def test_keys_and_coordination_are_reached_through_their_objects():
    """`store.keys.add_api_key(...)`, `store.coordination.acquire_lease(...)`: a call of a
    domain's method on anything else (the store itself, above all) is refused."""
    domains = {
        "keys": _public_methods(KeyStore),
        "coordination": _public_methods(Coordination),
        "policies": _public_methods(PolicyStore),
    }
    wrong = []
    for name, path in _outside_the_store().items():
        tree = ast.parse(path.read_text(), str(path))
        own = _protocol_methods(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr in own:
                continue
            for domain, methods in domains.items():
                via = node.value
                through = (isinstance(via, ast.Attribute) and via.attr == domain) or (
                    isinstance(via, ast.Name) and via.id == domain
                )
                if node.attr in methods and not through:
                    wrong.append(f"{name}:{node.lineno}: .{node.attr} not via .{domain}")
    assert not wrong, "\n".join(wrong)
