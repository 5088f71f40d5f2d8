"""Run the tests of an environment of its own (integrations_envs/NAME: a library whose pins conflict with the main
environment's) in that environment, from the repository root; and, there, run docs/environments.md's recipe.

    proc = run_env_tests("verifiers")      # its own python -m pytest integrations_envs/verifiers
    namespace = run_docs_recipe("verifiers")   # the no-run block whose first line names it, executed here
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def env_python(name: str) -> Path:
    return ROOT / "integrations_envs" / name / ".venv" / "bin" / "python"


def needs_env(name: str):
    """Skip, saying how to create it, when the environment is absent; in CI (which creates it) fail instead."""
    missing = not env_python(name).exists() and not os.environ.get("CI")
    return pytest.mark.skipif(missing, reason=f"the {name} environment is not created: `uv sync --locked --project "
                                              f"integrations_envs/{name}` (.ci/run creates it)")


def run_env_tests(name: str, timeout: float = 900) -> subprocess.CompletedProcess:
    python = env_python(name)
    assert python.exists(), f"integrations_envs/{name} has no environment (`uv sync --locked --project ...`)"
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([str(python), "-m", "pytest", f"integrations_envs/{name}", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def summary(proc: subprocess.CompletedProcess) -> dict[str, int]:
    """{"passed": n, "failed": n, ...} from pytest's closing line."""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", proc.stdout)}


def run_docs_recipe(name: str) -> dict:
    """Execute the docs/environments.md block marked not run (here) whose first line names `name`; its namespace."""
    from tests.project.test_docs import python_blocks

    page = ROOT / "docs" / "environments.md"
    found = [code for _, info, _, code in python_blocks(page)
             if info == "python no-run" and name in code.splitlines()[0]]
    assert len(found) == 1, f"docs/environments.md has {len(found)} recipes marked for {name}"
    namespace = {"__name__": "__main__"}
    exec(compile(found[0], f"docs/environments.md ({name})", "exec"), namespace)
    return namespace
