"""`collect_rollouts` calls `Env.reward` once per finished episode and `Env.close` after it; `episode_rewards`
reads the rewards back. A failing or missing reward is recorded, never scored 0."""

from __future__ import annotations

import threading

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType
from SimpleTorchLLMRL.env import Env, collect_rollouts, episode_rewards
from tests.support.scripted_agent import ScriptedGenerator


class Guess(Env):
    """Guess the answer in up to three turns; the reward is 1 / (turns used) when right, else 0."""

    max_turns = 3

    def __init__(self):
        self.closed: list[dict] = []
        self.lock = threading.Lock()

    def setup(self, question, answer=None):
        return [Message(str(question))], {"answer": answer, "turns": 0, "open": True}

    def step(self, rollout, state):
        state["turns"] += 1
        right = rollout.last(MessageType.MODEL).content.strip() == state["answer"]
        return ([] if right else [Message("no", MessageType.TOOL)]), right

    def reward(self, rollout, state):
        right = rollout.last(MessageType.MODEL).content.strip() == state["answer"]
        return 1.0 / state["turns"] if right else 0.0

    def close(self, state):
        with self.lock:
            assert state["open"], "closed twice"
            state["open"] = False
            self.closed.append(state)


REPLIES = {"a": ["1", "2", "3"], "b": ["7"], "c": ["x", "x", "x"]}


def test_each_episode_gets_its_envs_reward_and_is_closed_once():
    env = Guess()
    rollouts = collect_rollouts(ScriptedGenerator(REPLIES), env, ["a", "b", "c"], ["3", "7", "4"], group_size=2)
    assert [r.metadata["reward"] for r in rollouts] == [1 / 3, 1 / 3, 1.0, 1.0, 0.0, 0.0]
    assert [r.metadata["done_reason"] for r in rollouts] == ["env", "env", "env", "env", "max_turns", "max_turns"]
    assert torch.equal(episode_rewards(rollouts), torch.tensor([1 / 3, 1 / 3, 1.0, 1.0, 0.0, 0.0]))
    assert episode_rewards(rollouts).dtype == torch.float32
    assert len(env.closed) == 6 and not any(s["open"] for s in env.closed)


class NoReward(Guess):
    def reward(self, rollout, state):
        return None if state["answer"] == "7" else super().reward(rollout, state)


def test_an_episode_without_a_reward_is_named_not_scored_zero():
    rollouts = collect_rollouts(ScriptedGenerator(REPLIES), NoReward(), ["a", "b"], ["3", "7"])
    assert "reward" not in rollouts[1].metadata and rollouts[0].metadata["reward"] == 1 / 3
    with pytest.raises(ValueError, match=r"rollouts \[1\] carry no metadata\['reward'\].*returned None"):
        episode_rewards(rollouts)


class Broken(Guess):
    def reward(self, rollout, state):
        if state["answer"] == "7":
            raise RuntimeError("the grader is down")
        if state["answer"] == "4":
            return float("nan")
        return super().reward(rollout, state)


def test_a_failing_reward_is_recorded_and_the_batch_still_finishes():
    env = Broken()
    rollouts = collect_rollouts(ScriptedGenerator(REPLIES), env, ["a", "b", "c"], ["3", "7", "4"])
    assert rollouts[0].metadata["reward"] == 1 / 3
    assert rollouts[1].metadata["reward_error"] == "RuntimeError: the grader is down"
    assert "finite number" in rollouts[2].metadata["reward_error"]
    assert "reward" not in rollouts[1].metadata and "reward" not in rollouts[2].metadata
    assert len(env.closed) == 3
    with pytest.raises(ValueError, match="rollouts \\[1, 2\\].*the grader is down"):
        episode_rewards(rollouts)


class Batched(Guess):
    """An env with a batch scorer (as CodeEnv): its caller scores, collect_rollouts does not."""

    def reward(self, rollout, state):
        raise AssertionError("collect_rollouts must leave a batch-scored env's reward to its caller")

    def score(self, rollouts):
        return torch.zeros(len(rollouts))


def test_an_env_that_scores_batches_is_not_scored_per_episode():
    env = Batched()
    rollouts = collect_rollouts(ScriptedGenerator(REPLIES), env, ["a", "b"], ["3", "7"])
    assert not any("reward" in r.metadata or "reward_error" in r.metadata for r in rollouts)
    assert len(env.closed) == 2


class Exploding:
    def __init__(self, after: int):
        self.calls, self.after = 0, after

    def batch_rollout_generate_response(self, rollouts):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("out of memory")
        ScriptedGenerator(REPLIES).batch_rollout_generate_response(rollouts)


def test_every_started_episode_is_closed_when_generation_raises():
    env = Guess()
    with pytest.raises(RuntimeError, match="out of memory"):
        collect_rollouts(Exploding(after=1), env, ["a", "c"], ["3", "4"], group_size=2)
    assert len(env.closed) == 4


class BadSetup(Guess):
    def setup(self, question, answer=None):
        if question == "c":
            raise KeyError("no such row")
        return super().setup(question, answer)


def test_a_failing_setup_raises_after_closing_the_episodes_that_started():
    env = BadSetup()
    with pytest.raises(KeyError, match="no such row"):
        collect_rollouts(ScriptedGenerator(REPLIES), env, ["a", "b", "c"], ["3", "7", "4"])
    assert len(env.closed) == 2
