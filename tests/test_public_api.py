"""The public import paths are part of the contract (docs/architecture.md): they must keep working."""

import importlib
import subprocess
import sys

import pytest

import SimpleTorchLLMRL

SEED_PATHS = [
    ("SimpleTorchLLMRL.chat.message", "Rollout"),
    ("SimpleTorchLLMRL.chat.message", "Message"),
    ("SimpleTorchLLMRL.chat.message", "MessageType"),
    ("SimpleTorchLLMRL.model.generate", "ModelGenerate"),
    ("SimpleTorchLLMRL.trainer.GRPO", "GRPO"),
    ("SimpleTorchLLMRL.reward.boxed", "BoxedReward"),
    ("SimpleTorchLLMRL.env.QASolve", "QASolverEnv"),
    ("SimpleTorchLLMRL.env.ToolQASolve", "ToolUseEnv"),
]

ROUTER_NAMES = ["RouterDataConfig", "RouterGenerationConfig", "RouterToolConfig", "RouterRewardConfig",
                "RouterTrainerConfig", "RouterValidationConfig", "RouterTrainingConfig"]


@pytest.mark.parametrize("module,name", SEED_PATHS)
def test_seed_import_paths(module, name):
    assert getattr(importlib.import_module(module), name) is getattr(SimpleTorchLLMRL, name)


@pytest.mark.parametrize("name", SimpleTorchLLMRL.__all__)
def test_every_exported_name_resolves(name):
    assert getattr(SimpleTorchLLMRL, name) is not None


def test_router_r1_names_exported_from_the_package():
    """Earlier users imported the Router-R1 configs from the package: they still resolve (outside `__all__`)."""
    for name in ROUTER_NAMES:
        assert getattr(SimpleTorchLLMRL, name).__module__.startswith("SimpleTorchLLMRL.recipes.router_r1")


EARLIER_NAMES = ["Batch", "EncodedRollout", "collate", "encode_prompt", "encode_rollouts", "as_sampled",
                 "save_rollouts", "load_rollouts", "RolloutWriter", "token_logprobs", "logprob_drift",
                 "QASolverEnv", "ToolUseEnv", "Tool", "CombinedReward", "MetricsLogger"]


@pytest.mark.parametrize("name", EARLIER_NAMES)
def test_names_exported_by_an_earlier_release_still_resolve(name):
    assert getattr(SimpleTorchLLMRL, name) is not None


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        SimpleTorchLLMRL.Nope  # noqa: B018


def test_package_import_is_light():
    """Importing the package loads neither torch nor transformers (names load on first use)."""
    code = "import sys, SimpleTorchLLMRL; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
