"""SimpleTorchLLMRL: small, composable PyTorch primitives for RL on language models.

The front door holds the names a user's loop needs; everything else is imported
from its sub-package (see the README's file map). Each name loads on first use
(PEP 562), so `import SimpleTorchLLMRL` stays light and has no side effects.

The Router-R1 names the seed exported here still resolve, silently (a seed path, part of
the contract). Other names an earlier release exported here (the encode helpers', the
rollout files', ...) still resolve with a DeprecationWarning naming their one import path
(CHANGELOG.md lists them). None of these is part of `__all__`.
"""

from __future__ import annotations

import importlib

_FRONT_DOOR = {
    "SimpleTorchLLMRL.chat.message": ["Message", "MessageType", "Rollout"],
    "SimpleTorchLLMRL.chat.tokenize": ["encode_rollout", "rollouts_to_batch"],
    "SimpleTorchLLMRL.model.generation.generator": ["ModelGenerate"],
    "SimpleTorchLLMRL.env.base": ["Env"],
    "SimpleTorchLLMRL.env.rollouts": ["collect_rollouts"],
    "SimpleTorchLLMRL.trainer.GRPO": ["GRPO"],
    "SimpleTorchLLMRL.trainer.PPO": ["PPO"],
    "SimpleTorchLLMRL.reward.boxed": ["BoxedReward"],
    "SimpleTorchLLMRL.tools": ["tool", "ToolRegistry"],
}

_EARLIER = {  # resolve with a DeprecationWarning naming the module to import them from
    "SimpleTorchLLMRL.chat.tokenize": ["Batch", "EncodedRollout", "collate", "encode_prompt", "encode_rollouts",
                                       "as_sampled"],
    "SimpleTorchLLMRL.chat.rollout_io": ["save_rollouts", "load_rollouts", "RolloutWriter"],
    "SimpleTorchLLMRL.model.scoring.logprobs": ["token_logprobs"],
    "SimpleTorchLLMRL.trainer.drift": ["logprob_drift"],
    "SimpleTorchLLMRL.env": ["QASolverEnv", "ToolUseEnv"],
    "SimpleTorchLLMRL.tools": ["Tool"],
    "SimpleTorchLLMRL.reward": ["CombinedReward"],
    "SimpleTorchLLMRL.utils.metrics": ["MetricsLogger"],
    "SimpleTorchLLMRL.recipes.router_r1": ["RouterEnv", "RoutingPool", "CallableModel", "HFModel", "OpenAIModel"],
}

_SEED = {  # the names the seed's package exported: silent, a seed path
    "SimpleTorchLLMRL.recipes.router_r1": [
        "RouterDataConfig", "RouterGenerationConfig", "RouterToolConfig", "RouterRewardConfig",
        "RouterTrainerConfig", "RouterValidationConfig", "RouterTrainingConfig", "RouterGenerationManager",
        "RouterReward", "RouterR1Trainer",
    ],
}


def _where(table: dict[str, list[str]]) -> dict[str, str]:
    return {name: module for module, names in table.items() for name in names}


_WHERE = _where(_EARLIER) | _where(_SEED) | _where(_FRONT_DOOR)
_DEPRECATED = _where(_EARLIER)

__all__ = sorted(_where(_FRONT_DOOR))


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'SimpleTorchLLMRL' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    if name in _DEPRECATED:
        from SimpleTorchLLMRL.utils.warn import warn_user

        warn_user(f"SimpleTorchLLMRL.{name} is deprecated; use `from {module} import {name}`", DeprecationWarning)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
