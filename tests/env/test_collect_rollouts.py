"""collect_rollouts: the batched multi-turn loop, against a scripted env and a scripted generator."""

import threading
import time

import pytest

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt, encode_rollout
from SimpleTorchLLMRL.env.base import Env
from SimpleTorchLLMRL.env.rollouts import collect_rollouts


class ScriptedGenerator:
    """Appends "turn k" MODEL messages and records each batch it was given."""

    def __init__(self, context_turns=None):
        self.batches = []
        self.context_turns = context_turns  # rollouts with this many MODEL turns no longer fit

    def batch_rollout_generate_response(self, rollouts, prompt_ids=None):
        self.batches.append([r.metadata["question"] for r in rollouts])
        self.prompts = prompt_ids
        for r in rollouts:
            k = sum(m.type is MessageType.MODEL for m in r)
            r.add_messages(Message(f"turn {k}", MessageType.MODEL, token_ids=[1, 2], logprobs=[-0.5, -0.5]))


class ContextGenerator(ScriptedGenerator):
    """Its "prompt ids": one id per MODEL turn so far; a prompt of `context_turns` of them no longer fits."""

    def prompt_ids(self, rollouts):
        return [[0] * sum(m.type is MessageType.MODEL for m in r) for r in rollouts]

    def fits(self, prompt_ids):
        return len(prompt_ids) < self.context_turns


class CountdownEnv(Env):
    """Episode for question q lasts q MODEL turns; each step answers with a TOOL message."""

    tools = [{"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]

    def __init__(self, delay=0.0, fail_on=None):
        self.delay, self.fail_on = delay, fail_on
        self.seen_states = []
        self.lock = threading.Lock()

    def setup(self, question, answer=None):
        return [Message(f"count {question}")], {"left": question, "steps": 0}

    def step(self, rollout, state):
        time.sleep(self.delay)
        with self.lock:
            self.seen_states.append(id(state))
        state["steps"] += 1
        if self.fail_on is not None and rollout.metadata["question"] == self.fail_on and state["steps"] == 2:
            raise RuntimeError("tool exploded")
        state["left"] -= 1
        return [Message(f"left {state['left']}", MessageType.TOOL)], state["left"] <= 0


def test_episodes_stop_at_the_right_turn_and_finished_ones_drop_out():
    gen, env = ScriptedGenerator(), CountdownEnv()
    rollouts = collect_rollouts(gen, env, [1, 3, 2], answers=["a", "b", "c"], group_size=2, max_turns=5)
    assert len(rollouts) == 6
    assert [r.metadata["turns"] for r in rollouts] == [1, 1, 3, 3, 2, 2]
    assert all(r.metadata["done_reason"] == "env" for r in rollouts)
    assert gen.batches == [[1, 1, 3, 3, 2, 2], [3, 3, 2, 2], [3, 3]]
    r = rollouts[2]  # question 3: user, then (MODEL, TOOL) x 3
    assert [m.type for m in r] == [MessageType.MESSAGE] + [MessageType.MODEL, MessageType.TOOL] * 3
    assert [m.content for m in r if m.type is MessageType.TOOL] == ["left 2", "left 1", "left 0"]


def test_group_metadata_tools_and_independent_states():
    env = CountdownEnv()
    rollouts = collect_rollouts(ScriptedGenerator(), env, [2, 1], answers=["x", "y"], group_size=3)
    assert [r.metadata["group_id"] for r in rollouts] == [0, 0, 0, 1, 1, 1]
    assert [r.metadata["answer"] for r in rollouts] == ["x"] * 3 + ["y"] * 3
    states = [r.metadata["env_state"] for r in rollouts]
    assert len({id(s) for s in states}) == 6 and [s["steps"] for s in states] == [2, 2, 2, 1, 1, 1]
    assert rollouts[0].metadata["tools"] == env.tools and rollouts[0].metadata["tools"] is not env.tools


def test_max_turns_caps_episodes():
    rollouts = collect_rollouts(ScriptedGenerator(), CountdownEnv(), [5, 1], max_turns=2)
    assert [r.metadata["turns"] for r in rollouts] == [2, 1]
    assert [r.metadata["done_reason"] for r in rollouts] == ["max_turns", "env"]
    env = CountdownEnv()
    env.max_turns = 3
    assert collect_rollouts(ScriptedGenerator(), env, [9])[0].metadata["turns"] == 3


def test_failing_step_becomes_a_tool_message_and_ends_only_that_episode():
    rollouts = collect_rollouts(ScriptedGenerator(), CountdownEnv(fail_on=3), [3, 4], max_turns=6)
    bad, good = rollouts
    assert bad.metadata["done_reason"] == "env_error" and "tool exploded" in bad.metadata["env_error"]
    assert bad[-1].type is MessageType.TOOL and "RuntimeError" in bad[-1].content and "tool exploded" in bad[-1].content
    assert bad.metadata["turns"] == 2
    assert good.metadata["done_reason"] == "env" and good.metadata["turns"] == 4


def test_bad_step_return_is_an_env_error():
    class Bad(CountdownEnv):
        def step(self, rollout, state):
            return "not a tuple"

    (r,) = collect_rollouts(ScriptedGenerator(), Bad(), [2])
    assert r.metadata["done_reason"] == "env_error" and "TypeError" in r[-1].content


def test_env_steps_of_one_turn_run_concurrently():
    env = CountdownEnv(delay=0.3)
    start = time.perf_counter()
    collect_rollouts(ScriptedGenerator(), env, [1] * 8, max_workers=8)
    assert time.perf_counter() - start < 0.3 * 8 / 2  # serial would take 2.4 s


def test_context_overflow_ends_the_episode_after_the_first_turn():
    rollouts = collect_rollouts(ContextGenerator(context_turns=2), CountdownEnv(), [5, 1], max_turns=5)
    assert [r.metadata["turns"] for r in rollouts] == [2, 1]
    assert [r.metadata["done_reason"] for r in rollouts] == ["context", "env"]


@pytest.mark.parametrize("kwargs, word", [
    (dict(group_size=0), "group_size"), (dict(answers=["a"]), "answers"), (dict(max_turns=0), "max_turns"),
])
def test_bad_arguments(kwargs, word):
    with pytest.raises(ValueError, match=word):
        collect_rollouts(ScriptedGenerator(), CountdownEnv(), [1, 2], **kwargs)


def test_empty_questions():
    assert collect_rollouts(ScriptedGenerator(), CountdownEnv(), []) == []


def test_with_the_real_generator_every_turn_keeps_the_prefix_invariant(chatml_tokenizer):
    from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
    from SimpleTorchLLMRL.testing.tiny import tiny_model

    tok = chatml_tokenizer
    gen = ModelGenerate(tiny_model("qwen2", tok), tok, max_new_tokens=6, temperature=1.0, seed=0)
    prompts = {}
    real = gen.batch_rollout_generate_response

    def record(rs, prompt_ids=None):
        for k, r in enumerate(rs):
            prompts.setdefault(id(r), []).append(encode_prompt(r, tok))
            assert prompt_ids is None or prompt_ids[k] == prompts[id(r)][-1]  # passed on as encoded
        real(rs, prompt_ids=prompt_ids)

    gen.batch_rollout_generate_response = record
    rollouts = collect_rollouts(gen, CountdownEnv(), [2, 1], group_size=2, max_turns=3)
    assert [r.metadata["turns"] for r in rollouts] == [2, 2, 1, 1]
    for r in rollouts:
        enc = encode_rollout(r, tok).input_ids
        models = [m for m in r if m.type is MessageType.MODEL]
        for prompt, msg in zip(prompts[id(r)], models, strict=True):
            assert enc[: len(prompt) + len(msg.token_ids)] == prompt + msg.token_ids
    assert isinstance(rollouts[0], Rollout)
