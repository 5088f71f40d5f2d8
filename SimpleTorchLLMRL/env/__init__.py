"""Environments: the `Env` protocol, QA / tool-use / code envs, triggers, and `collect_rollouts`."""

from SimpleTorchLLMRL.env.base import Env, SingleTurnEnv
from SimpleTorchLLMRL.env.code import CodeEnv, CodeScores, Verdict
from SimpleTorchLLMRL.env.code_formats import CodeTests
from SimpleTorchLLMRL.env.qa_solver import QASolverEnv
from SimpleTorchLLMRL.env.rollouts import collect_rollouts, episode_rewards
from SimpleTorchLLMRL.env.tool_use import ToolEpisode, ToolUseEnv, tool_stats
from SimpleTorchLLMRL.env.triggers import CodeTrigger, NoneTrigger, Trigger, TriggerEnv, TriggerEpisode

__all__ = [
    "CodeEnv",
    "CodeScores",
    "CodeTests",
    "CodeTrigger",
    "Env",
    "NoneTrigger",
    "QASolverEnv",
    "SingleTurnEnv",
    "ToolEpisode",
    "ToolUseEnv",
    "Trigger",
    "TriggerEnv",
    "TriggerEpisode",
    "Verdict",
    "collect_rollouts",
    "episode_rewards",
    "tool_stats",
]

