"""Environments: the `Env` protocol, QA / tool-use / code envs, triggers, `collect_rollouts`, turn-based games."""

from SimpleTorchLLMRL.env.base import Env, SingleTurnEnv
from SimpleTorchLLMRL.env.code import CodeEnv, CodeScores, Verdict
from SimpleTorchLLMRL.env.code_formats import CodeTests
from SimpleTorchLLMRL.env.games import Game, collect_game_rollouts
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
    "Game",
    "NoneTrigger",
    "QASolverEnv",
    "SingleTurnEnv",
    "ToolEpisode",
    "ToolUseEnv",
    "Trigger",
    "TriggerEnv",
    "TriggerEpisode",
    "Verdict",
    "collect_game_rollouts",
    "collect_rollouts",
    "episode_rewards",
    "tool_stats",
]

