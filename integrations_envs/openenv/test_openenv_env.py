"""OpenEnv 0.10.0: one WebSocket session per episode (the stateless HTTP routes score a right answer as wrong),
the env's rewards recorded by collect_rollouts, sessions closed, real GRPO steps, and docs/environments.md's
OpenEnv recipe run as written. Run in integrations_envs/openenv's own environment."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from sum_env import SumEnvironment, make_app

from SimpleTorchLLMRL import collect_rollouts
from SimpleTorchLLMRL.chat.message import Message, MessageType
from SimpleTorchLLMRL.env import episode_rewards
from SimpleTorchLLMRL.integrations.openenv import OpenEnvEnv
from tests.support.grpo_steps import grpo_steps, tiny_policy
from tests.support.integration_envs import run_docs_recipe
from tests.support.local_server import serve_app


@pytest.fixture(scope="module")
def server():
    app = make_app()
    with serve_app(app) as base:
        yield base, app


def question_answer(prompt: str) -> str:
    a, b = map(int, re.findall(r"\d+", prompt)[:2])
    return str(a + b)


class Scripted:
    """Answers each episode's question: right, wrong, or wrong then right, by the seed's parity rule below."""

    def __init__(self, plan):
        self.plan = plan  # seed -> replies, one per turn

    def batch_rollout_generate_response(self, rollouts):
        for r in rollouts:
            turn = sum(m.type is MessageType.MODEL for m in r)
            right = question_answer(next(m.content for m in r if m.type is MessageType.MESSAGE))
            reply = self.plan[r.metadata["question"]["seed"]][turn]
            r.add_messages(Message(reply.replace("RIGHT", right), MessageType.MODEL))


def test_the_stateless_http_routes_score_a_right_answer_as_wrong(server):
    """Why the adapter holds a session: /reset and /step each build a fresh environment."""
    base, _ = server
    with httpx.Client(base_url=base, timeout=30) as http:
        question = http.post("/reset", json={"seed": 5}).json()["observation"]["question"]
        step = http.post("/step", json={"action": {"answer": f"\\boxed{{{question_answer(question)}}}"}}).json()
    assert step["reward"] == 0.0  # a fresh instance asked no question: the right answer is "wrong"
    env = OpenEnvEnv(base, action="answer", observe="question")
    [rollout] = collect_rollouts(Scripted({5: ["\\boxed{RIGHT}"]}), env, [{"seed": 5}])
    assert rollout[0].content == question and rollout.metadata["reward"] == 1.0


def test_episodes_are_scored_by_their_own_sessions_and_closed(server):
    base, _ = server
    env = OpenEnvEnv(base, action="answer", observe=lambda o: o["feedback"] or o["question"],
                     system_prompt="Answer in \\boxed{}.")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "11 + 23"}}</tool_call>'
    plan = {1: ["\\boxed{RIGHT}"], 2: ["I think", "\\boxed{RIGHT}"], 3: [call, "\\boxed{0}"], 4: ["a", "b", "c"]}
    rollouts = collect_rollouts(Scripted(plan), env, [{"seed": s} for s in plan], group_size=2)
    assert episode_rewards(rollouts).tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert [r.metadata["turns"] for r in rollouts] == [1, 1, 2, 2, 2, 2, 3, 3]
    again, called = rollouts[2], rollouts[4]
    assert [m.type for m in again] == [MessageType.SYSTEM, MessageType.MESSAGE, MessageType.MODEL,
                                       MessageType.TOOL, MessageType.MODEL]
    assert again[3].content == "Answer in \\boxed{}." and called[3].content == "34"  # the session's calculator
    assert all(r.metadata["done_reason"] == "env" for r in rollouts)
    deadline = time.monotonic() + 10
    while SumEnvironment.live and time.monotonic() < deadline:  # the server closes a session's env on its own
        time.sleep(0.05)
    assert SumEnvironment.live == set()  # every episode's session was closed


def test_questions_are_reset_arguments(server):
    base, _ = server
    env = OpenEnvEnv(base, action="answer", observe="question")
    messages, episode = env.setup(7)
    try:
        assert messages[0].content == "What is 17 + 41?"  # seed 7
    finally:
        env.close(episode)
    with pytest.raises(TypeError, match="reset's arguments"):
        env.setup("What is 1 + 1?")
    with pytest.raises(ValueError, match="base_url"):
        OpenEnvEnv("localhost:8000")


def test_grpo_steps_on_openenv_episodes(server):
    base, _ = server
    model, tok, gen = tiny_policy(max_new_tokens=40, seed=2, tool_call_stop=["</tool_call>"])
    from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT

    env = OpenEnvEnv(base, action="answer", observe=lambda o: o["feedback"] or o["question"],
                     system_prompt=SYSTEM_PROMPT, max_turns=3)
    seeds = iter(range(100))  # 4 sums a step, 4 tries each

    def collect():
        rollouts = collect_rollouts(gen, env, [{"seed": next(seeds)} for _ in range(4)], group_size=4)
        return rollouts, episode_rewards(rollouts)

    grpo_steps(model, tok, collect, steps=2, group_size=4)


def test_the_docs_recipe_runs_as_written():
    namespace = run_docs_recipe("OpenEnv")
    assert len(namespace["rollouts"]) > 0
