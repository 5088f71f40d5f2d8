"""The shape of the house (docs/architecture.md): no import cycles, a small package root, recipes apart from the library."""

from __future__ import annotations

import ast
from pathlib import Path

import SimpleTorchLLMRL

PACKAGE = Path(SimpleTorchLLMRL.__file__).parent
ROOT = "SimpleTorchLLMRL"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = [ROOT, *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _packages_on_the_way(target: str, importer: str) -> list[str]:
    """Packages whose __init__ runs when `target` is imported, except the importer's own ancestors."""
    parts = target.split(".")
    ancestors = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 2)}
    return [p for p in (".".join(parts[:i]) for i in range(2, len(parts))) if p not in ancestors]


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (at module level or inside functions)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from pkg import sub` runs pkg/__init__ even inside pkg: an edge to pkg itself
                targets |= {resolve(node.module)} | {resolve(f"{node.module}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names}
        targets.discard(None)
        for t in list(targets):
            targets |= set(_packages_on_the_way(t, module))
        targets.discard(module)
        targets.discard(ROOT)  # the root resolves names lazily and imports nothing itself
        graph[module] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None (iterative DFS with colours)."""
    state = dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done
    for start in graph:
        if state[start]:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
            elif state[child] == 1:
                path = [n for n, _ in stack]
                return path[path.index(child):] + [child]
            elif state[child] == 0:
                state[child] = 1
                stack.append((child, iter(sorted(graph[child]))))
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_packages_on_the_way_skip_the_importers_own():
    assert _packages_on_the_way("SimpleTorchLLMRL.tools.landlock", "SimpleTorchLLMRL.env.code") == [
        "SimpleTorchLLMRL.tools"]
    assert _packages_on_the_way("SimpleTorchLLMRL.tools.landlock", "SimpleTorchLLMRL.tools.sandbox") == []


def test_the_library_never_imports_a_recipe():
    graph = import_graph()
    recipe = f"{ROOT}.recipes"
    offenders = {m: sorted(t for t in targets if t.startswith(recipe))
                 for m, targets in graph.items() if not m.startswith(recipe)}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_at_most_three_modules_at_the_package_root():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 3, loose


def test_the_front_door_is_small():
    assert 10 <= len(SimpleTorchLLMRL.__all__) <= 16, SimpleTorchLLMRL.__all__
