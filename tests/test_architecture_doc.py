"""The project explains itself: docs/architecture.md matches the files, main.py reads as phases, the README is
about the product, and benchmarks/results holds one current file per benchmark."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_file_the_architecture_page_names_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:SimpleTorchLLMRL|tests|benchmarks)/[\w/.]+|main\.py)`", text))
    named |= {f"SimpleTorchLLMRL/{p}" for p in re.findall(r"`(\w+/\w+\.py)`", text) if not p.startswith("tests/")}
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
