"""One import path per public name (docs/architecture.md, "Package `__init__` files and import paths"): README.md,
main.py, docs/ and examples/ import each name of the library from the front door when `SimpleTorchLLMRL.__all__` has
it, else from the outermost package whose `__all__` has it, else from the module that defines it."""

from __future__ import annotations

import ast
import importlib
import re
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import SimpleTorchLLMRL

ROOT = Path(__file__).resolve().parents[1]
LIB = "SimpleTorchLLMRL"


def canonical_path(module: str, name: str) -> str:
    """The one module a user's code should import `name` (found in `module`) from."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # an old path still names an object
        obj = getattr(importlib.import_module(module), name)
    if isinstance(obj, types.ModuleType):
        return module  # `from SimpleTorchLLMRL.model.scoring import logprobs`: a module is imported from its package
    if name in SimpleTorchLLMRL.__all__ and getattr(SimpleTorchLLMRL, name) is obj:
        return LIB
    home = getattr(obj, "__module__", None)
    if not (isinstance(home, str) and home.startswith(f"{LIB}.")
            and getattr(importlib.import_module(home), name, None) is obj):
        home = module  # a constant, or an instance whose class lives elsewhere: where it was found
    parts = home.split(".")
    for i in range(2, len(parts)):
        package = importlib.import_module(".".join(parts[:i]))
        if name in getattr(package, "__all__", ()) and getattr(package, name) is obj:
            return package.__name__
    return home


def sources() -> Iterator[tuple[str, str]]:
    """(where, Python source) for main.py, each example, and each ```python block of README.md and docs/."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, block in enumerate(re.findall(r"^```python(?: no-run)?\n(.*?)^```", page.read_text(), re.M | re.S)):
            yield f"{page.relative_to(ROOT)} (python block {i + 1})", block
    for path in [ROOT / "main.py", *sorted((ROOT / "examples").rglob("*.py"))]:
        yield str(path.relative_to(ROOT)), path.read_text()


def off_path_imports(where: str, source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []  # a block that shows a fragment (docs/test_docs.py decides which blocks run)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(LIB):
            for alias in node.names:
                want = canonical_path(node.module, alias.name)
                if want != node.module:
                    found.append(f"{where}:{node.lineno}: from {node.module} import {alias.name} -> from {want}")
    return found


def test_the_rule_picks_the_front_door_then_the_package_then_the_module():
    assert canonical_path("SimpleTorchLLMRL.trainer.grpo", "GRPO") == LIB
    assert canonical_path("SimpleTorchLLMRL.env.ToolQASolve", "ToolUseEnv") == "SimpleTorchLLMRL.env"
    assert canonical_path("SimpleTorchLLMRL.tools.calculator", "calculator") == "SimpleTorchLLMRL.tools"
    assert canonical_path("SimpleTorchLLMRL.recipes.router_r1.pool", "RoutingPool") == \
        "SimpleTorchLLMRL.recipes.router_r1"
    assert canonical_path("SimpleTorchLLMRL.trainer.options", "ComputeOptions") == \
        "SimpleTorchLLMRL.model.scoring.logprobs"
    assert canonical_path("SimpleTorchLLMRL.model.scoring.logprobs", "token_logprobs") == \
        "SimpleTorchLLMRL.model.scoring.logprobs"
    assert canonical_path("SimpleTorchLLMRL.testing.tiny", "TINY_CALC") == "SimpleTorchLLMRL.testing.tiny"


def test_an_off_path_import_is_named():
    snippet = "from SimpleTorchLLMRL.chat.message import Message\nfrom SimpleTorchLLMRL import GRPO\n"
    assert off_path_imports("x", snippet) == [
        "x:1: from SimpleTorchLLMRL.chat.message import Message -> from SimpleTorchLLMRL"]


def test_readme_main_docs_and_examples_import_each_name_from_its_one_path():
    scanned = list(sources())
    assert len(scanned) > 40
    assert [p for where, src in scanned for p in off_path_imports(where, src)] == []
