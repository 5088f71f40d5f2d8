"""verifiers and OpenEnv run in environments of their own (integrations_envs/NAME: their pins conflict with this
environment's and with each other's). This runs each environment's tests there: traces and episodes scored
exactly, failures dropped and counted, real GRPO steps, and the docs/environments.md recipe as written."""

from __future__ import annotations

import sys

import pytest

from tests.support.integration_envs import needs_env, run_env_tests, summary


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_env(n)) for n in ("verifiers", "openenv")])
def test_the_environment_passes_its_tests(name):
    proc = run_env_tests(name)
    counts = summary(proc)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert counts.get("passed", 0) >= 5 and set(counts) == {"passed"}, proc.stdout[-2000:]


def test_without_its_environment_each_bridge_names_its_extra(monkeypatch):
    """The bridges import without their library (the main environment has neither); the first call says which
    extra installs it."""
    from SimpleTorchLLMRL.integrations.openenv import OpenEnvEnv
    from SimpleTorchLLMRL.integrations.verifiers import collect

    monkeypatch.setitem(sys.modules, "verifiers", None)
    monkeypatch.setitem(sys.modules, "openenv", None)
    with pytest.raises(ImportError, match="'verifiers' extra"):
        collect("tiny_sum", object(), tasks=1, group_size=1)
    with pytest.raises(ImportError, match="'openenv' extra"):
        OpenEnvEnv("http://127.0.0.1:1").setup(None)
