"""Which turn drifts? Sampled vs recomputed log-probs, per message, role and turn.

Collects multi-turn calculator episodes (the model's tool call, the TOOL result, its
answer), recomputes the log-probs of every sampled token the way GRPO does, and prints
`logprob_drift`'s report twice:

1. as trained: the same weights and temperature as the sampler, so the gap is float noise;
2. with a trainer that differs from the sampler: the model's weights in bfloat16 (a stand-in
   for another backend's numerics, or weights that moved since sampling). The report shows how
   large the gap gets and which turns carry it.

    uv run python examples/drift_report.py
    uv run python examples/drift_report.py --model Qwen/Qwen2.5-0.5B-Instruct --questions 4

Legend: Q questions (--questions), G samples per question (--group-size), R = Q * G rollouts.
"""

from __future__ import annotations

import argparse
import copy

import torch

from SimpleTorchLLMRL import GRPO, BoxedReward, ModelGenerate, collect_rollouts
from SimpleTorchLLMRL.env import ToolUseEnv
from SimpleTorchLLMRL.recipes.calculator import arithmetic
from SimpleTorchLLMRL.testing.tiny import load_model_or_tiny
from SimpleTorchLLMRL.tools import calculator
from SimpleTorchLLMRL.trainer.drift import logprob_drift


def drift_under(model, tokenizer, rollouts, rewards, group_size: int):
    """GRPO's recomputed log-probs of every sampled token (in micro-batches of 4), and the drift report."""
    grpo = GRPO(model, tokenizer, group_size=group_size, temperature=1.0)
    parts = []
    for micro in grpo.prepare(rollouts, rewards).split(4):
        out = grpo.compute(micro)  # LossOutput(loss, metrics, token_logprobs)
        parts.append((micro.batch, out.token_logprobs.float()))
    return logprob_drift(rollouts, parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF model dir or hub id (default: the embedded tiny_calc)")
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    model, tokenizer, what = load_model_or_tiny(args.model, seed=args.seed)
    env = ToolUseEnv([calculator], custom_sys_prompt=arithmetic.SYSTEM_PROMPT, max_turns=3)
    problems = arithmetic.generate_problems(args.questions, seed=args.seed, split="test")
    gen = ModelGenerate(model, tokenizer, max_new_tokens=32, temperature=1.0, seed=args.seed,
                        tool_call_stop=env.stop_strings)
    rollouts = collect_rollouts(gen, env, [p.question for p in problems], [p.answer for p in problems],
                                group_size=args.group_size)  # (R,)
    rewards = BoxedReward()(rollouts, [r.metadata["answer"] for r in rollouts])  # (R,)
    print(f"{what}: {len(rollouts)} episodes, {sum(r.metadata['turns'] for r in rollouts)} sampled turns\n")

    print("1. trainer = sampler (same weights, float32):")
    print(drift_under(model, tokenizer, rollouts, rewards, args.group_size), "\n")

    print("2. trainer in bfloat16 (a stand-in for another backend's numerics):")
    shifted = copy.deepcopy(model).to(torch.bfloat16)
    print(drift_under(shifted, tokenizer, rollouts, rewards, args.group_size))


if __name__ == "__main__":
    main()
