"""The suite in two stages: the fast tests first, then the slow ones; a failure in the fast stage ends the run.

`tests/conftest.py` installs these hooks, so `uv run pytest` (the README's command, and CI's) runs both stages
in one process, collecting once. The slow stage is every test marked `slow`, `vllm` or `distributed`.
"""

from __future__ import annotations

import pytest

SLOW_STAGE = ("slow", "vllm", "distributed")  # markers of the slow stage (pyproject.toml declares them)


def in_slow_stage(item) -> bool:
    return any(item.get_closest_marker(name) for name in SLOW_STAGE)


def pytest_collection_modifyitems(items):
    """The fast stage runs first, then the slow one (end-to-end runs, the real vLLM engine, torchrun), each in
    file order: a run that breaks something cheap says so within minutes."""
    items[:] = [i for i in items if not in_slow_stage(i)] + [i for i in items if in_slow_stage(i)]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A failure in the fast stage ends the run where the slow stage would begin (exit status 1)."""
    result = yield
    session = item.session
    if session.testsfailed and nextitem is not None and in_slow_stage(nextitem) and not in_slow_stage(item):
        session.shouldfail = (f"{session.testsfailed} failed in the fast stage; "
                              f"the slow stage ({', '.join(SLOW_STAGE)}) did not run")
    return result
