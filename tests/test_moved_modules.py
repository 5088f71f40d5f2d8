"""The modules that moved into model/generation and model/scoring keep their old import paths for one release:
the same module object, one DeprecationWarning naming the new path, pointing at the importing line."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import SimpleTorchLLMRL.model as model_pkg
from SimpleTorchLLMRL.utils import warn
from SimpleTorchLLMRL.utils.moved import FINDER

ROOT = Path(__file__).resolve().parents[1]
MODULE_ROWS = {old: new for old, new in model_pkg.MOVED.items() if ":" not in old}
NAME_ROWS = {old: new for old, new in model_pkg.MOVED.items() if ":" in old}


def _forget(old: str) -> None:
    """As if this process had never imported `old`: no cached alias, no attribute on the parent, not yet warned."""
    sys.modules.pop(old, None)
    parent, _, child = old.rpartition(".")
    vars(sys.modules[parent]).pop(child, None)
    warn.DEPRECATED_SEEN.discard(old)


def _deprecations(caught) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, DeprecationWarning) and "is deprecated" in str(w.message)]


def test_the_table_names_every_module_that_left_model():
    """Every old row is gone from model/ and its new module exists; sixteen modules moved."""
    assert len(MODULE_ROWS) == 16
    for old, new in MODULE_ROWS.items():
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), old
        assert (ROOT / (new.replace(".", "/") + ".py")).is_file(), new
    assert set(FINDER.modules) >= set(MODULE_ROWS)


@pytest.mark.parametrize("old", sorted(MODULE_ROWS))
def test_an_old_path_imports_the_same_module_and_warns_once(old):
    new = importlib.import_module(MODULE_ROWS[old])
    _forget(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = importlib.import_module(old)
        again = importlib.import_module(old)
    assert first is new and again is new
    dep = _deprecations(caught)
    assert [str(w.message) for w in dep] == [f"{old} is deprecated; use {MODULE_ROWS[old]}"]


def test_the_three_spellings_give_one_object_and_the_warning_names_the_importing_line():
    old = "SimpleTorchLLMRL.model.logprobs"
    from SimpleTorchLLMRL.model.scoring import logprobs as real

    _forget(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import SimpleTorchLLMRL.model.logprobs as by_import  # noqa: I001
        from SimpleTorchLLMRL.model import logprobs as by_from
        from SimpleTorchLLMRL.model.logprobs import token_logprobs
    assert by_import is by_from is real and token_logprobs is real.token_logprobs
    (only,) = _deprecations(caught)
    assert only.filename == __file__  # the import line above, not the import system's or the library's


def test_from_the_package_import_old_warns_at_the_caller():
    old = "SimpleTorchLLMRL.model.sampling"
    _forget(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from SimpleTorchLLMRL.model import sampling
    from SimpleTorchLLMRL.model.generation import sampling as real

    assert sampling is real
    (only,) = _deprecations(caught)
    assert only.filename == __file__


def test_monkeypatching_through_the_old_path_patches_the_real_module(monkeypatch):
    import SimpleTorchLLMRL.model.logprobs as L

    from SimpleTorchLLMRL.model.scoring import logprobs as real

    before = real._chunk_tokens(real._DeviceChunks, None, 1000)
    monkeypatch.setattr(L, "GPU_CHUNK_BYTES", 64 * 4 * 1000)
    assert real.GPU_CHUNK_BYTES == 64 * 4 * 1000
    assert real._chunk_tokens(real._DeviceChunks, None, 1000) == 64 != before


@pytest.mark.parametrize("row", sorted(NAME_ROWS))
def test_a_name_that_left_logprobs_still_imports_from_its_old_path(row):
    module, _, name = row.partition(":")
    home = importlib.import_module(NAME_ROWS[row])
    importlib.import_module(module)  # the alias (and its warning) may already exist
    warn.DEPRECATED_SEEN.discard(f"{module}.{name}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = getattr(sys.modules[module], name)
        again = getattr(sys.modules[module], name)
    assert got is again is getattr(home, name)
    assert [str(w.message) for w in _deprecations(caught)] == [
        f"{module}.{name} is deprecated; use {NAME_ROWS[row]}.{name}"]


def test_an_unknown_name_is_still_an_attribute_error():
    import SimpleTorchLLMRL.model.logprobs as L

    with pytest.raises(AttributeError, match="no_such_name"):
        L.no_such_name  # noqa: B018
    with pytest.raises(AttributeError, match="no_such_module"):
        model_pkg.no_such_module  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("SimpleTorchLLMRL.model.no_such_module")


def test_the_seed_path_and_the_new_paths_import_silently_the_old_ones_do_not():
    """In a fresh interpreter with DeprecationWarning as an error (nothing cached from other tests)."""
    quiet = ("import SimpleTorchLLMRL.model.generate; from SimpleTorchLLMRL.model.generate import ModelGenerate; "
             + "; ".join(f"import {new}" for new in sorted(set(model_pkg.MOVED.values()))))
    run = lambda code: subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],  # noqa: E731
                                      capture_output=True, text=True, cwd=ROOT, timeout=120)
    ok = run(quiet)
    assert ok.returncode == 0, ok.stderr
    loud = run("from SimpleTorchLLMRL.model import picker")
    assert loud.returncode != 0 and "SimpleTorchLLMRL.model.picker is deprecated" in loud.stderr


def test_a_table_row_outside_its_package_is_refused():
    from SimpleTorchLLMRL.utils.moved import alias_moved

    with pytest.raises(ValueError, match="direct children"):
        alias_moved("SimpleTorchLLMRL.model", {"SimpleTorchLLMRL.trainer.x": "SimpleTorchLLMRL.model.y"})


def test_the_changelog_lists_every_row_of_the_table():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    for old, new in MODULE_ROWS.items():
        assert f"| `{old}` | `{new}` |" in changelog, old
    for row, home in NAME_ROWS.items():
        _, _, name = row.partition(":")
        line = next((ln for ln in changelog.splitlines() if f".{name}`" in ln and f"`{home}`" in ln), None)
        assert line is not None, row


@pytest.mark.parametrize("seed,name,home,left", [
    ("SimpleTorchLLMRL.env.QASolve", "QASolverEnv", "SimpleTorchLLMRL.env.qa_solver", ["DEFAULT_QA_PROMPT"]),
    ("SimpleTorchLLMRL.env.ToolQASolve", "ToolUseEnv", "SimpleTorchLLMRL.env.tool_use",
     ["ToolEpisode", "tool_stats", "default_tool_prompt"]),
])
def test_the_seed_env_modules_keep_their_env_silently_and_warn_for_the_rest(seed, name, home, left):
    """env/QASolve.py and env/ToolQASolve.py are seed paths over the modules named after what they hold."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seed_module = importlib.import_module(seed)
        assert getattr(seed_module, name) is getattr(importlib.import_module(home), name)
    assert _deprecations(caught) == []
    for old in left:
        warn.DEPRECATED_SEEN.discard(f"{seed}.{old}")
        with pytest.warns(DeprecationWarning, match=rf"{seed}\.{old} is deprecated; use {home}\.{old}"):
            assert getattr(seed_module, old) is getattr(importlib.import_module(home), old)
    with pytest.raises(AttributeError, match="nope"):
        seed_module.nope  # noqa: B018
