"""The seed's README still runs: each Python snippet it showed, as written, in order, in one namespace.

The seed README (the project's first published README) taught these import paths and calls; users copied
them. Only what cannot run here is replaced, each replacement listed in SUBSTITUTIONS: "gpt2" from the hub
becomes the embedded tiny model (TINY_CALC, loaded with the Auto classes since it is not a GPT-2), and the
names the seed left to the reader (`model`, `tokenizer`, `dataset`, `question`, `answer`, `rewards`,
`optimizer`) are defined by a prelude. The assertions after the snippets say what each one should have done.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from SimpleTorchLLMRL.testing.tiny import TINY_CALC

# The seed README's python blocks, in its order, verbatim (comments trimmed).
SEED_SNIPPETS = {
    "the rollout system": '''
from SimpleTorchLLMRL.chat.message import Rollout, Message, MessageType

rollout = Rollout()
rollout.add_messages(Message("You are a helpful math tutor", MessageType.SYSTEM))
rollout.add_messages(Message("What is 2 + 3?", MessageType.MESSAGE))
rollout.add_messages(Message("2 + 3 = 5", MessageType.MODEL))
''',
    "message types": '''
MessageType.SYSTEM
MessageType.MESSAGE
MessageType.MODEL
''',
    "model generation": '''
from SimpleTorchLLMRL.model.generate import ModelGenerate

generator = ModelGenerate(
    model=model,
    tokenizer=tokenizer,
    max_new_tokens=100,
    temperature=0.7
)

response = generator.rollout_generate_response(rollout)

generator.batch_rollout_generate_response(rollouts)
''',
    "training with GRPO": '''
from SimpleTorchLLMRL.trainer.GRPO import GRPO

trainer = GRPO(
    model=model,
    tokenizer=tokenizer,
    eps=0.2
)

loss = trainer.calculate_loss(rollouts=rollouts, rewards=rewards)
loss.backward()
optimizer.step()
''',
    "reward functions": '''
from SimpleTorchLLMRL.reward.boxed import BoxedReward

reward_fn = BoxedReward()
rewards = reward_fn(rollouts, ground_truths)
''',
    "environments": '''
from SimpleTorchLLMRL.env.QASolve import QASolverEnv

env = QASolverEnv(custom_sys_prompt="Solve this math problem:")
initial_messages, state = env.setup(question, answer)
''',
    "quick start": '''
import torch
from transformers import GPT2LMHeadModel, GPT2Tokenizer
from SimpleTorchLLMRL.chat.message import Rollout, Message, MessageType
from SimpleTorchLLMRL.model.generate import ModelGenerate
from SimpleTorchLLMRL.trainer.GRPO import GRPO
from SimpleTorchLLMRL.reward.boxed import BoxedReward

model = GPT2LMHeadModel.from_pretrained("gpt2")
tokenizer = GPT2Tokenizer.from_pretrained("gpt2")
tokenizer.pad_token = tokenizer.eos_token

generator = ModelGenerate(model=model, tokenizer=tokenizer)
trainer = GRPO(model=model, tokenizer=tokenizer, eps=0.2)
reward_fn = BoxedReward()
optimizer = torch.optim.Adam(model.parameters())

rollouts = []
ground_truths = []

for question, answer in dataset:
    rollout = Rollout()
    rollout.add_messages(Message("Solve this problem:", MessageType.SYSTEM))
    rollout.add_messages(Message(question, MessageType.MESSAGE))

    response = generator.rollout_generate_response(rollout)
    rollout.add_messages(response)

    rollouts.append(rollout)
    ground_truths.append(answer)

rewards = reward_fn(rollouts, ground_truths)
loss = trainer.calculate_loss(rollouts, rewards)

optimizer.zero_grad()
loss.backward()
optimizer.step()
''',
    "tool integration": '''
rollout.add_messages(Message("calculate(2 + 3)", MessageType.MODEL))
rollout.add_messages(Message("Result: 5", MessageType.SYSTEM))
rollout.add_messages(Message("The answer is 5", MessageType.MODEL))
''',
    "multi-agent": '''
rollout.add_messages(Message("I think the answer is 4", MessageType.MODEL))
rollout.add_messages(Message("Actually, let me double-check that calculation...", MessageType.MODEL))
rollout.add_messages(Message("calculate(2 + 3)", MessageType.MODEL))
rollout.add_messages(Message("Result: 5", MessageType.SYSTEM))
rollout.add_messages(Message("The correct answer is 5", MessageType.MODEL))
''',
}

# What cannot run here (a hub download), and what it becomes: (seed line, line run instead).
SUBSTITUTIONS = [
    ('model = GPT2LMHeadModel.from_pretrained("gpt2")', "model = AutoModelForCausalLM.from_pretrained(TINY_CALC)"),
    ('tokenizer = GPT2Tokenizer.from_pretrained("gpt2")', "tokenizer = AutoTokenizer.from_pretrained(TINY_CALC)"),
]

# The names the seed's snippets take as given.
PRELUDE = '''
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(TINY_CALC)
tokenizer = AutoTokenizer.from_pretrained(TINY_CALC)
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
dataset = [("What is 2 + 3?", "5"), ("What is 7 * 6?", "42")]
question, answer = dataset[0]
'''


def run_seed_readme() -> dict:
    ns = {"TINY_CALC": TINY_CALC, "__name__": "seed_readme"}
    exec(PRELUDE, ns)
    for title, code in SEED_SNIPPETS.items():
        if title == "model generation":  # the seed's "rollouts" here: copies of the rollout so far
            ns["rollouts"] = [ns["rollout"].copy(), ns["rollout"].copy()]
        if title == "training with GRPO":
            ns["rewards"] = torch.tensor([1.0, 0.0])
        if title == "reward functions":
            ns["ground_truths"] = ["5", "5"]
        for seed_line, here in SUBSTITUTIONS:
            code = code.replace(seed_line, here)
        exec(compile(code, f"seed README: {title}", "exec"), ns)
        ns.setdefault("done", []).append(title)
    return ns


@pytest.fixture(scope="module")
def seed_run():
    return run_seed_readme()


def test_every_seed_snippet_runs(seed_run):
    assert seed_run["done"] == list(SEED_SNIPPETS)


def test_each_substitution_replaces_a_line_the_seed_shows():
    shown = "\n".join(SEED_SNIPPETS.values())
    assert all(seed_line in shown for seed_line, _ in SUBSTITUTIONS)


def test_the_seed_snippets_did_what_they_say(seed_run):
    from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout

    rollouts, rewards, loss = seed_run["rollouts"], seed_run["rewards"], seed_run["loss"]
    assert [type(r) for r in rollouts] == [Rollout, Rollout]  # the quick start's two questions
    assert [m.type for m in rollouts[0]] == [MessageType.SYSTEM, MessageType.MESSAGE, MessageType.MODEL]
    assert rollouts[1] is seed_run["rollout"]  # the loop's last rollout, which the later snippets extend
    sampled = rollouts[0][-1]  # as sampled: the ids and log-probs the trainer uses
    assert sampled.token_ids and len(sampled.logprobs) == len(sampled.token_ids)
    assert rewards.shape == (2,) and rewards.dtype == torch.float32
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert isinstance(seed_run["response"], Message) and seed_run["response"].type is MessageType.MODEL
    initial, state = seed_run["initial_messages"], seed_run["state"]
    assert [(m.type, m.content) for m in initial] == [(MessageType.SYSTEM, "Solve this math problem:"),
                                                      (MessageType.MESSAGE, "What is 2 + 3?")]
    assert state == {"answer": "5"}
    # the last rollout: the quick start's, then the tool and multi-agent turns appended to it
    assert [m.type for m in seed_run["rollout"]][3:] == [MessageType.MODEL, MessageType.SYSTEM, MessageType.MODEL,
                                                         MessageType.MODEL, MessageType.MODEL, MessageType.MODEL,
                                                         MessageType.SYSTEM, MessageType.MODEL]


def test_the_seed_router_r1_package_imports():
    """"The `SimpleTorchLLMRL.router_r1` package bundles the components required to reproduce the
    Router-R1 ... recipe": the name is the recipe's package, its modules the recipe's modules."""
    seed = importlib.import_module("SimpleTorchLLMRL.router_r1")
    recipe = importlib.import_module("SimpleTorchLLMRL.recipes.router_r1")
    assert seed is recipe
    for name in ("config", "generation", "reward", "trainer"):  # the seed package's modules kept here
        assert importlib.import_module(f"SimpleTorchLLMRL.router_r1.{name}") is getattr(recipe, name)
    from SimpleTorchLLMRL.router_r1 import RouterR1Trainer, RouterReward, RouterTrainingConfig

    assert RouterR1Trainer.__module__ == "SimpleTorchLLMRL.recipes.router_r1.trainer"
    assert RouterReward is recipe.RouterReward and RouterTrainingConfig is recipe.RouterTrainingConfig


def test_the_router_r1_examples_the_seed_names_exist():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert (root / "examples" / "router_r1_training.py").is_file()
    assert (root / "examples" / "router_r1_math_qwen.py").is_file()
