"""SimpleTorchLLMRL: small, composable PyTorch primitives for RL on language models.

The public names below are importable from the package itself; each is loaded
on first use (PEP 562), so `import SimpleTorchLLMRL` stays light and has no
side effects.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "SimpleTorchLLMRL.chat.message": ["Message", "MessageType", "Rollout"],
    "SimpleTorchLLMRL.chat.tokenize": ["Batch", "EncodedRollout", "collate", "encode_prompt", "encode_rollout",
                                       "encode_rollouts", "rollouts_to_batch", "as_sampled"],
    "SimpleTorchLLMRL.chat.rollout_io": ["save_rollouts", "load_rollouts", "RolloutWriter"],
    "SimpleTorchLLMRL.model.generate": ["ModelGenerate"],
    "SimpleTorchLLMRL.model.logprobs": ["token_logprobs"],
    "SimpleTorchLLMRL.trainer.GRPO": ["GRPO"],
    "SimpleTorchLLMRL.trainer.PPO": ["PPO"],
    "SimpleTorchLLMRL.trainer.drift": ["logprob_drift"],
    "SimpleTorchLLMRL.env.base": ["Env"],
    "SimpleTorchLLMRL.env.rollouts": ["collect_rollouts"],
    "SimpleTorchLLMRL.env.QASolve": ["QASolverEnv"],
    "SimpleTorchLLMRL.env.ToolQASolve": ["ToolUseEnv"],
    "SimpleTorchLLMRL.tools": ["Tool", "ToolRegistry", "tool"],
    "SimpleTorchLLMRL.reward.boxed": ["BoxedReward"],
    "SimpleTorchLLMRL.reward": ["CombinedReward"],
    "SimpleTorchLLMRL.logging": ["MetricsLogger"],
    "SimpleTorchLLMRL.router_r1": [
        "RouterDataConfig", "RouterGenerationConfig", "RouterToolConfig", "RouterRewardConfig",
        "RouterTrainerConfig", "RouterValidationConfig", "RouterTrainingConfig", "RouterGenerationManager",
        "RouterEnv", "RouterReward", "RouterR1Trainer", "RoutingPool", "CallableModel", "HFModel", "OpenAIModel",
    ],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'SimpleTorchLLMRL' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
