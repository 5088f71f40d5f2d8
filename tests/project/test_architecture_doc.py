"""The project explains itself: docs/architecture.md matches the files, main.py reads as phases, the README is
about the product, and benchmarks/results holds one current file per benchmark."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_file_the_architecture_page_names_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:SimpleTorchLLMRL|tests|benchmarks)/[\w/.]+|main\.py)`", text))
    named |= {f"SimpleTorchLLMRL/{p}" for p in re.findall(r"`(\w+/\w+\.py)`", text)
              if not p.startswith(("tests/", "SimpleTorchLLMRL/"))}
    assert len(named) > 15
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing


def test_no_function_in_main_is_over_60_lines():
    tree = ast.parse((ROOT / "main.py").read_text())
    long = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60}
    assert not long, long


def test_the_readme_is_short_and_holds_no_benchmark_status_table():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    table_rows = [line for line in lines if line.startswith("|")]
    numbers = [line for line in table_rows if re.search(r"\d+(\.\d+)?\s*(s|x|×|GB|MiB)\s*\|", line)]
    assert not [line for line in numbers if "TRL" in line], "benchmark tables live in docs/benchmarks.md"
    assert not [line for line in table_rows if "speed-up" in line]
    assert not [line for line in lines if re.search(r"\b(session|lent|the team)\b", line, re.I)]


def test_one_results_file_per_benchmark():
    results = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir())
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    stems = [re.sub(r"_gpu$", "", Path(name).stem) for name in results]
    assert all(stem in scripts for stem in stems), results
    assert len(stems) == len(set(stems)) or all(n.endswith(".json") for n in results)
    assert not [n for n in results if re.search(r"\d{4}-\d{2}-\d{2}|before", n)], results


# ----------------------------------------------------------------------------- the tables match the tree

PACKAGE = ROOT / "SimpleTorchLLMRL"


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start: end if end != -1 else len(text)]


def table_rows(text: str) -> list[list[str]]:
    """The cells of each body row of the markdown tables in `text` (header and rule rows left out)."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in lines
            if not re.fullmatch(r"\|[-| ]+\|", line.strip())][1:]


def library_tree() -> dict[str, list[str]]:
    """package path (relative, with a trailing /; the root as `SimpleTorchLLMRL/`) -> its module stems."""
    packages = sorted(p for p in PACKAGE.rglob("*") if (p / "__init__.py").is_file() and "__pycache__" not in p.parts)
    tree = {f"{p.relative_to(PACKAGE).as_posix()}/": sorted(m.stem for m in p.glob("*.py") if m.stem != "__init__")
            for p in packages}
    return {f"{PACKAGE.name}/": sorted(m.stem for m in PACKAGE.glob("*.py") if m.stem != "__init__"), **tree}


def test_the_file_table_matches_the_tree():
    rows = table_rows(section((ROOT / "docs" / "architecture.md").read_text(), "Every file"))
    table = {}
    for package, modules in rows:
        name = package.strip("`")
        assert name not in table, f"{name} has two rows"
        table[name] = [] if modules.startswith("none") else sorted(re.findall(r"`(\w+)`", modules))
    assert table == library_tree()


def test_each_step_names_functions_defined_in_its_files():
    """The step table's second column names what its third column's files define (at module level)."""
    rows = table_rows(section((ROOT / "docs" / "architecture.md").read_text(), "Who owns each step"))
    assert len(rows) > 20
    missing = {}
    for step, functions, files in rows:
        paths = []
        for f in re.findall(r"`([^`]+)`", files):
            paths += sorted((ROOT / f).rglob("*.py")) if (ROOT / f).is_dir() else [ROOT / f]
        defined = set()
        for path in paths:
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    defined.add(node.name)
                elif isinstance(node, ast.Assign):
                    defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    defined.add(node.target.id)
        names = [re.split(r"[.(]", n)[0] for n in re.findall(r"`([^`]+)`", functions)]
        if [n for n in names if n and n not in defined]:
            missing[step] = [n for n in names if n and n not in defined]
    assert missing == {}


def test_the_readme_map_names_every_package_and_example():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Map of the package")
    the_map = readme[start: readme.index("\n## ", start + 1)]
    packages = {p.split("/")[0] for p in library_tree() if p != f"{PACKAGE.name}/"}
    missing = sorted(f"{p}/" for p in packages if not re.search(rf"^\s+{p}/\s", the_map, re.M))
    examples = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
    missing += sorted(f"examples/{e}.py" for e in examples if not re.search(rf"\b{e}\b", the_map))
    assert missing == []
