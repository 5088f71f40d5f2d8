"""The shape of the house (docs/architecture.md): no import cycles, a small package root, recipes apart from the library."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import SimpleTorchLLMRL

PACKAGE = Path(SimpleTorchLLMRL.__file__).parent
ROOT = "SimpleTorchLLMRL"
ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


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


SEED_TABLE = f"{ROOT}.seed"  # the seed's paths: module names as strings, resolved only when a seed path is imported


def test_the_library_never_imports_a_recipe():
    """No import statement of the library outside recipes/ (at module level or in a function) reaches a recipe."""
    graph = import_graph()
    recipe = f"{ROOT}.recipes"
    offenders = {m: sorted(t for t in targets if t.startswith(recipe))
                 for m, targets in graph.items() if not m.startswith(recipe)}
    assert {m: t for m, t in offenders.items() if t} == {}


def recipe_names_in_strings(package_dir: Path = PACKAGE) -> list[str]:
    """Where a library module outside recipes/ names a recipe's module in a string (what `importlib` would
    import), seed.py's table and docstrings aside."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir)
        if rel.parts[0] == "recipes" or rel.as_posix() == "seed.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        found += [f"{rel}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in prose
                  and isinstance(n.value, str) and re.search(rf"\b{ROOT}\.recipes\b", n.value)]
    return found


def test_no_library_module_names_a_recipe_to_import_it_at_run_time():
    assert recipe_names_in_strings() == []


def test_the_string_check_catches_an_importlib_import_of_a_recipe(tmp_path):
    import shutil

    copy = tmp_path / ROOT
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    target = copy / "env" / "base.py"
    target.write_text(target.read_text() + "\n\ndef _late():\n    import importlib\n\n"
                      f"    return importlib.import_module(\"{ROOT}.recipes.calculator.arithmetic\")\n")
    assert recipe_names_in_strings(copy) == [f"env/base.py:{len(target.read_text().splitlines())}"]


def test_importing_every_library_module_loads_no_recipe():
    """In a fresh interpreter: every module outside recipes/ imported, and not one recipe module came with them."""
    import subprocess
    import sys

    modules = sorted(m for m in _modules() if not m.startswith(f"{ROOT}.recipes") and not m.endswith("__main__"))
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n    importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.startswith('{ROOT}.recipes')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE.parent)
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(modules) > 100 and run.stdout.split("\n")[-2] == "[]"


def test_at_most_three_modules_at_the_package_root():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 3, loose


def test_module_files_are_lower_case():
    """The seed's upper-case module names live on as seed paths (seed.py), not as files."""
    upper = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.stem != p.stem.lower()}
    assert upper == set()


def test_the_front_door_is_small():
    assert 10 <= len(SimpleTorchLLMRL.__all__) <= 16, SimpleTorchLLMRL.__all__


# ----------------------------------------------------------------------------- the declared layers


def declared_layers(text: str) -> list[list[str]]:
    """The ```text layers block of docs/architecture.md: one line per layer, top first."""
    m = re.search(r"^```text layers\n(.*?)^```", text, re.M | re.S)
    assert m, "docs/architecture.md has no ```text layers block"
    return [line.split() for line in m.group(1).splitlines() if line.strip()]


def package_imports(package_dir: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> where, for every import statement in the library: at module
    level, inside functions and under `if TYPE_CHECKING` alike. The root package's own file is the front
    door (listed as ROOT); `from SimpleTorchLLMRL import x` is an import of it."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir)
        src = rel.parts[0] if len(rel.parts) > 1 else ROOT
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] if node.module != ROOT else [f"{ROOT}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level > 0:
                raise AssertionError(f"{rel}:{node.lineno}: a relative import; the library imports absolutely")
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] != ROOT:
                    continue
                dst = parts[1] if len(parts) > 1 and (package_dir / parts[1]).is_dir() else ROOT
                if dst != src:
                    edges.setdefault((src, dst), []).append(f"{rel}:{node.lineno}")
    return edges


def layering_problems(layers: list[list[str]], edges: dict[tuple[str, str], list[str]],
                      packages: set[str]) -> list[str]:
    """Every import that points sideways or up the declared layers, and every package not declared once."""
    level = {name: i for i, line in enumerate(layers) for name in line}  # 0 = top
    declared = [name for line in layers for name in line]
    problems = [f"{name} is declared {declared.count(name)} times" for name in sorted(set(declared))
                if declared.count(name) > 1]
    problems += [f"package {name} is not in the layers block" for name in sorted(packages - set(level))]
    problems += [f"the layers block names {name}, which is no package" for name in sorted(set(level) - packages)]
    for (src, dst), where in sorted(edges.items()):
        if dst == ROOT:
            problems.append(f"{src} imports the front door ({', '.join(where)})")
        elif src != ROOT and src in level and dst in level and level[dst] <= level[src]:
            side = "on its own line" if level[dst] == level[src] else "above it"
            problems.append(f"{src} imports {dst}, {side} ({', '.join(where)})")
    return problems


def library_packages(package_dir: Path = PACKAGE) -> set[str]:
    return {p.name for p in package_dir.iterdir() if (p / "__init__.py").is_file()}


def test_package_imports_follow_the_declared_layers():
    layers = declared_layers(ARCHITECTURE.read_text())
    assert layering_problems(layers, package_imports(), library_packages()) == []


def test_the_layers_leave_no_loop_at_package_level():
    """The declared order forbids loops; this also holds them absent from the imports themselves."""
    graph: dict[str, set[str]] = {p: set() for p in library_packages()}
    for src, dst in package_imports():
        if src != ROOT:
            graph[src].add(dst)
    assert find_cycle(graph) is None


def test_utils_imports_no_library_package():
    assert sorted(dst for src, dst in package_imports() if src == "utils") == []


@pytest.mark.parametrize("module,line,problem", [
    ("utils/checkpoint.py", "from SimpleTorchLLMRL.model.lora import is_peft_model",
     "utils imports model, above it"),
    ("model/generation/generator.py", "    from SimpleTorchLLMRL.trainer.grpo import GRPO  # lazily",
     "model imports trainer, above it"),
    ("tools/base.py", "from SimpleTorchLLMRL.reward.boxed import BoxedReward", "tools imports reward, on its own line"),
    ("chat/message.py", "from SimpleTorchLLMRL import Rollout", "chat imports the front door"),
    ("env/base.py", "from SimpleTorchLLMRL.recipes.calculator import arithmetic", "env imports recipes, above it"),
])
def test_the_layering_check_catches_a_wrong_import(tmp_path, module, line, problem):
    """Each kind of wrong import, written into a copy of the library, is named (so the test can fail)."""
    import shutil

    copy = tmp_path / ROOT
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    target = copy / module
    body = target.read_text()
    if line.startswith("    "):  # a function-local import counts like a module-level one
        body += f"\n\ndef _late():\n{line}\n"
    else:
        body += f"\n{line}\n"
    target.write_text(body)
    layers = declared_layers(ARCHITECTURE.read_text())
    problems = layering_problems(layers, package_imports(copy), library_packages(copy))
    assert [p for p in problems if p.startswith(problem)], problems


def test_a_package_missing_from_the_layers_is_named():
    layers = [["recipes"], ["chat"]]
    assert layering_problems(layers, {}, {"recipes", "chat", "scoring"}) == [
        "package scoring is not in the layers block"]


# ----------------------------------------------------------------------------- package __init__ files


def init_policy_problems(init: Path) -> list[str]:
    """The rule for a package's __init__.py (docs/architecture.md): a docstring saying what the package holds;
    then either no imports at all, or eager re-exports whose names are exactly `__all__`."""
    tree = ast.parse(init.read_text(encoding="utf-8"))
    where = init.parent.name
    problems = [] if ast.get_docstring(tree) else [f"{where}: no docstring"]
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    imported.discard("annotations")  # from __future__
    listed = next((ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)), None)
    if imported and set(listed or []) != imported:
        problems.append(f"{where}: __all__ is not the names it imports "
                        f"(not listed: {sorted(imported - set(listed or []))}, "
                        f"not imported: {sorted(set(listed or []) - imported)})")
    if not imported and listed:
        problems.append(f"{where}: __all__ without imports")
    return problems


def test_every_package_init_follows_one_policy():
    inits = sorted(p for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)
    assert len(inits) >= 12
    assert [p for init in inits for p in init_policy_problems(init)] == []


def test_the_init_policy_check_names_each_breach(tmp_path):
    cases = {"": "no docstring", '"""Doc."""\nfrom x import a, b\n__all__ = ["a"]\n': "not listed: ['b']",
             '"""Doc."""\n__all__ = ["a"]\n': "__all__ without imports"}
    init = tmp_path / "pkg" / "__init__.py"
    init.parent.mkdir()
    for body, problem in cases.items():
        init.write_text(body)
        assert any(problem in p for p in init_policy_problems(init)), (body, problem)
    init.write_text('"""Doc."""\nfrom x import a, b\n__all__ = ["b", "a"]\n')
    assert init_policy_problems(init) == []


# ----------------------------------------------------------------------------- inside model/


def test_scoring_imports_no_other_part_of_model():
    """model/scoring is the bottom of model/: generation and the fronts use it, it uses neither (nor lora)."""
    scoring = f"{ROOT}.model.scoring"
    outside = {m: sorted(t for t in targets if t.startswith(f"{ROOT}.model") and not t.startswith(scoring)
                         and t != f"{ROOT}.model")
               for m, targets in import_graph().items() if m.startswith(scoring)}
    assert len(outside) >= 8
    assert {m: t for m, t in outside.items() if t} == {}


def generation_imports(graph: dict[str, set[str]], package: str = f"{ROOT}.trainer") -> dict[str, list[str]]:
    """The modules of `package` that import the generation side of `model` (model/generation, model/generate)."""
    generation = (f"{ROOT}.model.generation", f"{ROOT}.model.generate")
    found = {m: sorted(t for t in targets if t.startswith(generation)) for m, targets in graph.items()
             if m == package or m.startswith(f"{package}.")}
    return {m: t for m, t in found.items() if t}


def test_the_trainer_never_imports_generation():
    """docs/architecture.md: the trainer uses scoring and the weights, never generation (also not inside a function)."""
    graph = import_graph()
    assert len([m for m in graph if m.startswith(f"{ROOT}.trainer.")]) >= 8
    assert generation_imports(graph) == {}
    bad = {**graph, f"{ROOT}.trainer.x": {f"{ROOT}.model.generation.vllm_engine"}}  # the check can fail
    assert generation_imports(bad) == {f"{ROOT}.trainer.x": [f"{ROOT}.model.generation.vllm_engine"]}
