"""GRPO with a calculator tool, on CPU: arithmetic questions answered in `\\boxed{}`.

The loop is yours, top to bottom: collect multi-turn rollouts (the model may call
the calculator as `<tool_call>` JSON; `ToolUseEnv` runs the call and returns a
TOOL message, which is never trained) -> reward -> GRPO loss -> backward -> step.
Each step logs the reward, its components, tool-call statistics and the GRPO
diagnostics to the console and to `<out>/metrics.jsonl`.

    uv run python examples/tool_use_grpo.py                      # default model, 6 steps
    uv run python examples/tool_use_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 50

Default model: the embedded `SimpleTorchLLMRL/assets/tiny_calc/` when it is built
(`examples/pretrain_tiny.py`), else a random-init tiny Qwen2 (`--model random`),
which shows the loop but learns little in a few steps.

Legend: Q questions per step (--batch-size), G samples per question (--group-size), R = Q * G rollouts.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from SimpleTorchLLMRL import GRPO, BoxedReward, MessageType, ModelGenerate, collect_rollouts
from SimpleTorchLLMRL.env import ToolUseEnv, tool_stats
from SimpleTorchLLMRL.model.dropout import disable_dropout
from SimpleTorchLLMRL.recipes.calculator import arithmetic
from SimpleTorchLLMRL.reward import CombinedReward, FormatReward
from SimpleTorchLLMRL.testing.tiny import (
    load_model_or_tiny as load_model,  # a dir / hub id, "random", or the embedded model
)
from SimpleTorchLLMRL.tools import calculator
from SimpleTorchLLMRL.utils.metrics import MetricsLogger


def episode_stats(rollouts) -> dict[str, float]:
    """Tool statistics, plus per-rollout means of MODEL turns and of turns cut at max_new_tokens."""
    n = len(rollouts)
    return {
        **tool_stats(rollouts),
        "turns": sum(r.metadata["turns"] for r in rollouts) / n,
        "truncated": sum(r.last(MessageType.MODEL).finish_reason == "length" for r in rollouts) / n,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=2, help="questions per step")
    ap.add_argument("--group-size", type=int, default=4, help="samples per question (GRPO group)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="HF model dir or hub id, or 'random' (default: tiny_calc if built)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default="runs/tool_use_grpo", help="metrics.jsonl goes here")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)

    model, tokenizer, described = load_model(args.model, args.seed)
    print(f"model: {described} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters)")
    env = ToolUseEnv([calculator], max_turns=args.max_turns)  # the default prompt names the tool and format
    generator = ModelGenerate(model, tokenizer, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              tool_call_stop=env.stop_strings, seed=args.seed)
    # 1.0 for the right number in the last \boxed{}, plus 0.1 for having a \boxed{} at all
    reward_fn = CombinedReward([(BoxedReward(), 1.0), (FormatReward(r"\\boxed\{.+?\}", mode="search"), 0.1)])
    disable_dropout(model)  # exact on-policy ratios
    grpo = GRPO(model, tokenizer, eps=0.2, beta=0.0, temperature=args.temperature)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    problems = arithmetic.iter_problems(args.seed, split="train")
    logger = MetricsLogger(args.out, config=vars(args))

    start = time.time()
    for step in range(1, args.steps + 1):
        batch = [p.to_row() for p in itertools.islice(problems, args.batch_size)]
        questions, answers = [b["question"] for b in batch], [b["answer"] for b in batch]

        rollouts = collect_rollouts(generator, env, questions, answers, group_size=args.group_size)  # R
        rewards = reward_fn(rollouts, [r.metadata["answer"] for r in rollouts])  # (R,)

        # eval mode throughout (no dropout), so the loss's log-probs are the sampler's distribution
        loss = grpo.calculate_loss(rollouts, rewards)  # groups come from metadata["group_id"]
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        m = grpo.metrics
        logger.log(step, {
            "reward/mean": rewards.mean(), **reward_fn.metrics(), **episode_stats(rollouts),
            "loss": loss.detach(), "grad_norm": grad_norm, "entropy": m["entropy"], "clip_frac": m["clip_frac"],
            "frac_constant_groups": m["frac_constant_groups"], "tokens": m["num_tokens"],
            "seconds": round(time.time() - start, 1),
        })
    logger.close()

    print("a rollout of the last step:\n" + "\n".join(f"  [{msg.role}] {msg.content[:160]!r}"
                                                      for msg in rollouts[0].messages[1:]))
    print(f"done: {args.steps} steps in {time.time() - start:.1f} s; metrics in {Path(args.out) / 'metrics.jsonl'}")


if __name__ == "__main__":
    main()
