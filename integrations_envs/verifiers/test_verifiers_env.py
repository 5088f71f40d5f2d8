"""verifiers 0.4.0 through the gateway: each trace is one gateway session, its rewards join its rollouts exactly,
a failed trace is dropped and counted, real GRPO steps train on the rollouts, and docs/environments.md's
verifiers recipe runs as written; on the token path (verifiers' renderer client on POST /inference/v1/generate)
the recorded ids are exactly `encode_rollout`'s. Run in integrations_envs/verifiers' own environment."""

from __future__ import annotations

import re

import pytest
import torch
import verifiers.v1 as vf
from tiny_sum import PROBLEMS, SumData, SumTask

from SimpleTorchLLMRL import ModelGenerate
from SimpleTorchLLMRL.chat.message import MessageType
from SimpleTorchLLMRL.chat.tokenize import encode_rollout
from SimpleTorchLLMRL.gateway import Gateway
from SimpleTorchLLMRL.integrations.verifiers import collect, load_env
from tests.support.grpo_steps import grpo_steps, tiny_policy
from tests.support.integration_envs import run_docs_recipe

SAMPLING = {"temperature": 1.0, "max_tokens": 24}


@pytest.fixture(scope="module")
def policy():
    return tiny_policy(max_new_tokens=24)


def test_each_trace_is_a_session_whose_rewards_join_its_rollouts(policy):
    model, tok, gen = policy
    gateway = Gateway(gen)
    batch = collect("tiny_sum", gateway, tasks=2, group_size=2, sampling=SAMPLING)
    assert batch.failed == 0 and batch.errors == []
    assert len(batch.rollouts) == 4 and gateway.sessions() == []  # every session taken off the gateway
    assert len({r.metadata["trace_id"] for r in batch.rollouts}) == 4
    keys = [r.metadata["group_id"] for r in batch.rollouts]
    assert keys[0] == keys[1] != keys[2] == keys[3]
    for k, (r, reward) in enumerate(zip(batch.rollouts, batch.rewards.tolist(), strict=True)):
        a, b = PROBLEMS[k // 2]  # task-major, one rollout per trace
        reply = r.last(MessageType.MODEL)
        assert r[-2].content == f"What is {a} + {b}?" and r.metadata["task"]["answer"] == str(a + b)
        boxed = re.findall(r"\\boxed\{([^{}]*)\}", reply.content)
        expected = {"correct": float(bool(boxed) and boxed[-1].strip() == str(a + b)),
                    "boxed": float("\\boxed{" in reply.content)}
        assert r.metadata["rewards"] == expected  # the taskset's own signals, recomputed here
        assert reward == pytest.approx(expected["correct"] + 0.5 * expected["boxed"])
        assert reply.token_ids and len(reply.logprobs) == len(reply.token_ids)  # as sampled, recorded
    assert batch.rewards.dtype == torch.float32


def test_a_failed_trace_is_dropped_and_counted_never_scored_zero(policy):
    _, _, gen = policy
    env = load_env(vf, "tiny_sum")
    tasks = [SumTask(SumData(prompt="What is 2 + 2?", answer="4", fail=True)),
             SumTask(SumData(prompt="What is 3 + 3?", answer="6"))]
    gateway = Gateway(gen)
    batch = collect(env, gateway, tasks=tasks, group_size=2, sampling=SAMPLING)
    assert batch.failed == 2 and len(batch.errors) == 2 and all("grader crashed" in e for e in batch.errors)
    assert len(batch.rollouts) == 2 and {r.metadata["task"]["answer"] for r in batch.rollouts} == {"6"}
    assert gateway.sessions() == []


class Spy(Gateway):
    """A gateway that keeps what `collect` takes off it: the recorded sessions, before they are joined."""

    def take(self, session_ids):
        self.taken = super().take(session_ids)
        return {name: [r.copy() for r in rollouts] for name, rollouts in self.taken.items()}


def flat(rollout) -> list[int]:
    return [t for m in rollout for t in m.token_ids]


def test_the_token_path_records_exact_ids(policy):
    model, tok, gen = policy
    gateway = Spy(gen)
    batch = collect("tiny_sum", gateway, tasks=2, group_size=2, sampling=SAMPLING, token_path=True)
    assert batch.failed == 0 and batch.errors == [] and len(batch.rollouts) == 4 and gateway.sessions() == []
    for k, r in enumerate(batch.rollouts):
        a, b = PROBLEMS[k // 2]
        [recorded] = gateway.taken[r.metadata["trace_id"]]  # the token session: the ids as sent and sampled
        assert recorded.metadata["prompt"] == "token_ids" and [m.type for m in recorded] == [MessageType.MESSAGE,
                                                                                              MessageType.MODEL]
        enc = encode_rollout(r, tok)
        assert enc.input_ids == flat(recorded)  # the conversation encodes to exactly the recorded ids
        assert [t for t, m in zip(enc.input_ids, enc.loss_mask, strict=True) if m] == recorded[-1].token_ids
        reply = r.last(MessageType.MODEL)
        assert reply.logprobs == recorded[-1].logprobs and reply.temperature == 1.0
        assert r[-2].content == f"What is {a} + {b}?" and r.metadata["task"]["answer"] == str(a + b)
        assert set(r.metadata["rewards"]) == {"correct", "boxed"} and r.metadata["session"] == r.metadata["trace_id"]


def test_a_renderer_that_renders_otherwise_drops_the_trace_naming_the_token():
    """The gateway's tokenizer here has a chat template with one more newline after the system turn than the
    model's own, which verifiers' renderer loads: the ids it sends cannot be the conversation's encoding."""
    model, tok, _ = tiny_policy()
    tok.chat_template = tok.chat_template.replace("+ messages[0].content + '<|im_end|>\\n' }}",
                                                  "+ messages[0].content + '<|im_end|>\\n\\n' }}")
    assert "<|im_end|>\\n\\n" in tok.chat_template
    gateway = Gateway(ModelGenerate(model, tok, max_new_tokens=8, temperature=1.0, seed=0))
    batch = collect("tiny_sum", gateway, tasks=1, group_size=2, sampling=SAMPLING, token_path=True)
    assert batch.failed == 2 and batch.rollouts == [] and gateway.sessions() == []
    assert all("differ from encode_rollout's at token" in e for e in batch.errors), batch.errors


def test_bad_arguments_are_named(policy):
    with pytest.raises(TypeError, match="verifiers.v1.Env or a taskset id"):
        collect(object(), Gateway(policy[2]), tasks=1, group_size=1)
    model, tok, _ = tiny_policy()
    tok.name_or_path = ""
    with pytest.raises(ValueError, match="tokenizer.name_or_path"):
        collect("tiny_sum", Gateway(ModelGenerate(model, tok)), tasks=1, group_size=1, token_path=True)


@pytest.mark.parametrize("token_path", [False, True])
def test_grpo_steps_on_verifiers_rollouts(policy, token_path):
    """The episodes run concurrently, so the gateway's batches (and with them the samples) differ from run to
    run: a step takes the first of up to four batches whose rewards differ within a group (a batch without
    any spread has no gradient at all)."""
    model, tok, gen = policy
    gateway = Gateway(gen)
    tries = []

    def step():
        for _ in range(4):
            batch = collect("tiny_sum", gateway, tasks=2, group_size=3, sampling=SAMPLING, token_path=token_path)
            tries.append(batch.failed)
            groups = {}
            for r, reward in zip(batch.rollouts, batch.rewards.tolist(), strict=True):
                groups.setdefault(r.metadata["group_id"], set()).add(reward)
            if any(len(rewards) > 1 for rewards in groups.values()):
                break
        return batch.rollouts, batch.rewards

    grpo_steps(model, tok, step, steps=2)
    assert set(tries) == {0} and len(tries) <= 8


def test_the_docs_recipe_runs_as_written():
    namespace = run_docs_recipe("verifiers")
    assert namespace["batch"].failed == 0 and len(namespace["batch"].rollouts) > 0
