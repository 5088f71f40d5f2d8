"""The TinyZero countdown task with a calculator tool, trained with GRPO on CPU.

Given numbers (e.g. [3, 7, 25]) and a target (46), write an arithmetic expression
that uses each number exactly once and equals the target: \\boxed{25 + 3 * 7}.
The model may try expressions with the calculator (`<tool_call>` JSON, run by
`ToolUseEnv`) before answering. Reward (TinyZero's scheme): 1.0 when the last
`\\boxed{}` holds an expression of + - * / and parentheses that uses exactly the
given numbers and that the calculator evaluates to the target; 0.1 (format credit)
for any other boxed answer; 0.0 without one.

    uv run python examples/countdown.py                                   # default model, 6 steps
    uv run python examples/countdown.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 100

Default model: the embedded `SimpleTorchLLMRL/assets/tiny_calc/` when it is built, else a
random-init tiny Qwen2 (`--model random`): it shows the loop, it does not solve countdown.

Legend: Q problems per step (--batch-size), G samples per problem (--group-size), R = Q * G rollouts.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

import torch

from SimpleTorchLLMRL import GRPO, ModelGenerate, collect_rollouts
from SimpleTorchLLMRL.env import ToolUseEnv, tool_stats
from SimpleTorchLLMRL.model.dropout import disable_dropout
from SimpleTorchLLMRL.reward import FunctionReward, extract_boxed
from SimpleTorchLLMRL.testing.tiny import (
    load_model_or_tiny as load_model,  # a dir / hub id, "random", or the embedded model
)
from SimpleTorchLLMRL.tools import CalculatorError, calculator, evaluate
from SimpleTorchLLMRL.utils.metrics import MetricsLogger

FORMAT_CREDIT = 0.1
QUESTION = ("Using the numbers {numbers}, create an expression that equals {target}. Use each number exactly "
            "once, with + - * / and parentheses. Give the expression in \\boxed{{}}, e.g. \\boxed{{(1 + 2) * 3}}.")


def make_problem(rng: random.Random, n_numbers: int = 3, max_number: int = 30, max_target: int = 100) -> dict:
    """{"numbers", "target", "solution"}: numbers combined at random with + - * / into a positive integer target."""
    if n_numbers < 2:
        raise ValueError(f"n_numbers must be >= 2, got {n_numbers}")
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(n_numbers)]
        terms = [str(n) for n in numbers]
        while len(terms) > 1:  # join two random terms until one expression is left
            a, b = (terms.pop(rng.randrange(len(terms))) for _ in range(2))
            terms.append(f"({a} {rng.choice('+-*/')} {b})")
        solution = terms[0][1:-1]
        try:
            value = evaluate(solution)
        except CalculatorError:  # division by zero
            continue
        if float(value).is_integer() and 1 <= value <= max_target:
            return {"numbers": numbers, "target": int(value), "solution": solution}


def countdown_score(text: str, problem: dict) -> float:
    """1.0 solved, FORMAT_CREDIT for another boxed answer, 0.0 for none (see the module docstring)."""
    expr = extract_boxed(text)
    if not expr:
        return 0.0
    if not re.fullmatch(r"[\d+\-*/()\s]+", expr) or "**" in expr or "//" in expr:
        return FORMAT_CREDIT  # only integers, + - * / and parentheses
    if sorted(int(n) for n in re.findall(r"\d+", expr)) != sorted(problem["numbers"]):
        return FORMAT_CREDIT  # each given number exactly once, no other numbers
    try:
        value = evaluate(expr)
    except CalculatorError:
        return FORMAT_CREDIT
    return 1.0 if abs(value - problem["target"]) < 1e-9 else FORMAT_CREDIT


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=2, help="problems per step")
    ap.add_argument("--group-size", type=int, default=4, help="samples per problem (GRPO group)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="HF model dir or hub id, or 'random' (default: tiny_calc if built)")
    ap.add_argument("--numbers", type=int, default=3, help="numbers per problem")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default="runs/countdown", help="metrics.jsonl goes here")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    model, tokenizer, described = load_model(args.model, args.seed)
    print(f"model: {described} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters)")
    env = ToolUseEnv([calculator], max_turns=args.max_turns)
    generator = ModelGenerate(model, tokenizer, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              tool_call_stop=env.stop_strings, seed=args.seed)
    reward_fn = FunctionReward(countdown_score, name="countdown")
    disable_dropout(model)  # exact on-policy ratios
    grpo = GRPO(model, tokenizer, eps=0.2, beta=0.0, temperature=args.temperature)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    logger = MetricsLogger(args.out, config=vars(args))

    start = time.time()
    for step in range(1, args.steps + 1):
        problems = [make_problem(rng, args.numbers) for _ in range(args.batch_size)]
        questions = [QUESTION.format(numbers=p["numbers"], target=p["target"]) for p in problems]

        rollouts = collect_rollouts(generator, env, questions, problems, group_size=args.group_size)  # R
        rewards = reward_fn(rollouts, [r.metadata["answer"] for r in rollouts])  # (R,)

        # eval mode throughout (no dropout), so the loss's log-probs are the sampler's distribution
        loss = grpo.calculate_loss(rollouts, rewards)  # groups come from metadata["group_id"]
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        m = grpo.metrics
        logger.log(step, {
            "reward/mean": rewards.mean(), "solved": (rewards == 1.0).float().mean(),
            "boxed": (rewards > 0).float().mean(),
            **tool_stats(rollouts),
            "loss": loss.detach(), "grad_norm": grad_norm, "entropy": m["entropy"],
            "frac_constant_groups": m["frac_constant_groups"], "seconds": round(time.time() - start, 1),
        })
    logger.close()

    print(f"last problem: {problems[-1]}")
    print("its first rollout:\n" + "\n".join(f"  [{msg.role}] {msg.content[:160]!r}"
                                             for msg in rollouts[-args.group_size].messages[1:]))
    print(f"done: {args.steps} steps in {time.time() - start:.1f} s; metrics in {Path(args.out) / 'metrics.jsonl'}")


if __name__ == "__main__":
    main()
