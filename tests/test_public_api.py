"""The public import paths are part of the contract (DESIGN.md): they must keep working."""

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
    for name in ROUTER_NAMES:
        assert name in SimpleTorchLLMRL.__all__
        assert getattr(SimpleTorchLLMRL, name).__module__.startswith("SimpleTorchLLMRL.router_r1")


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        SimpleTorchLLMRL.Nope  # noqa: B018


def test_package_import_is_light():
    """Importing the package loads neither torch nor transformers (names load on first use)."""
    code = "import sys, SimpleTorchLLMRL; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
