"""SimpleTorchLLMRL: small, composable PyTorch primitives for RL on language models.

The front door holds the names a user's loop needs (`__all__`); everything else is imported
from its sub-package (see the README's map). Each name loads on first use (PEP 562), so
`import SimpleTorchLLMRL` stays light. The seed's import paths, and the Router-R1 names the seed
exported here (outside `__all__`), are served by `seed.py`'s one table.
"""

from __future__ import annotations

import importlib

from SimpleTorchLLMRL.seed import SEED_NAMES, install

__version__ = "0.2.0"

_FRONT_DOOR = {
    "SimpleTorchLLMRL.chat.message": ["Message", "MessageType", "Rollout"],
    "SimpleTorchLLMRL.chat.tokenize": ["encode_rollout", "rollouts_to_batch"],
    "SimpleTorchLLMRL.model.generation.generator": ["ModelGenerate"],
    "SimpleTorchLLMRL.env.base": ["Env"],
    "SimpleTorchLLMRL.env.rollouts": ["collect_rollouts"],
    "SimpleTorchLLMRL.trainer.grpo": ["GRPO"],
    "SimpleTorchLLMRL.trainer.ppo": ["PPO"],
    "SimpleTorchLLMRL.reward.boxed": ["BoxedReward"],
    "SimpleTorchLLMRL.tools": ["tool", "ToolRegistry"],
}

_WHERE = {name: module for module, names in _FRONT_DOOR.items() for name in names}

__all__ = sorted(_WHERE)

install()


def __getattr__(name: str):
    module = _WHERE.get(name) or SEED_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'SimpleTorchLLMRL' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
