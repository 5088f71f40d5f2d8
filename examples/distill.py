"""On-policy distillation on CPU: train a teacher with main.py's GRPO job, then distill it into a fresh copy.

1. Teacher: `main.py` (GRPO with the calculator tool) trains the embedded tiny model for
   `--teacher-steps` steps; its final weights are the teacher.
2. Student: a fresh copy of the embedded model samples episodes (the env answers its calculator
   calls); the teacher scores every token the student sampled; the loss is the per-token reverse
   KL as an advantage (`trainer.distill.Distill`), no reward at all. Held-out greedy accuracy of
   the student is measured every `--eval-every` steps, the teacher's once.

    uv run python examples/distill.py                      # the full run (docs/losses.md#distillation)
    uv run python examples/distill.py --smoke              # a few seconds: 2 + 2 steps, 4 held-out problems
    uv run python examples/distill.py --output-dir runs/d --distill-steps 80

Outputs in --output-dir: teacher/ (main.py's run), distill.jsonl (one row per evaluation and
step), distill_curve.png (student accuracy per step against the teacher's and the start).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from SimpleTorchLLMRL import BoxedReward, ModelGenerate, collect_rollouts
from SimpleTorchLLMRL.env import ToolUseEnv
from SimpleTorchLLMRL.model.dropout import disable_dropout
from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT
from SimpleTorchLLMRL.recipes.calculator.data import load_data
from SimpleTorchLLMRL.recipes.calculator.evaluate import evaluate
from SimpleTorchLLMRL.recipes.calculator.train_loop import batch_at
from SimpleTorchLLMRL.testing.tiny import TINY_CALC
from SimpleTorchLLMRL.tools import calculator
from SimpleTorchLLMRL.trainer.distill import Distill
from SimpleTorchLLMRL.utils.training import clipped_step, seed_everything

ROOT = Path(__file__).resolve().parents[1]
SMOKE = dict(teacher_steps=2, distill_steps=2, batch_size=2, group_size=2, eval_size=4, eval_every=1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher-steps", type=int, default=40, help="main.py GRPO steps for the teacher")
    p.add_argument("--distill-steps", type=int, default=40, help="distillation steps for the student")
    p.add_argument("--batch-size", type=int, default=8, help="questions per step (teacher and student)")
    p.add_argument("--group-size", type=int, default=8, help="episodes per question")
    p.add_argument("--lr", type=float, default=3e-4, help="the student's AdamW learning rate")
    p.add_argument("--eval-size", type=int, default=200, help="held-out problems (greedy accuracy)")
    p.add_argument("--eval-every", type=int, default=5, help="student evaluations every this many steps")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output-dir", default="outputs/distill")
    p.add_argument("--smoke", action="store_true", help="a tiny run for CI: " + str(SMOKE))
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    return args


def train_teacher(args, out: Path) -> Path:
    """main.py's job, in this process; returns the folder of its final model."""
    spec = importlib.util.spec_from_file_location("grpo_main", ROOT / "main.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    argv = ["--steps", str(args.teacher_steps), "--batch-size", str(args.batch_size), "--group-size",
            str(args.group_size), "--eval-size", str(args.eval_size), "--eval-every", "0", "--pass-k-size", "0",
            "--checkpoint-every", "0", "--seed", str(args.seed), "--threads", str(args.threads),
            "--max-new-tokens", str(args.max_new_tokens), "--output-dir", str(out / "teacher"), "--restart"]
    status = job.main(argv)
    if status != 0:
        raise SystemExit(f"main.py (the teacher's GRPO run) exited with status {status}")
    return out / "teacher" / "final"


def held_out_accuracy(model, tokenizer, env, reward_fn, rows, args, step: int) -> float:
    model.eval()
    report, _ = evaluate(model, tokenizer, env, reward_fn, rows, k=1, k_problems=0, seed=args.seed + step,
                         max_new_tokens=args.max_new_tokens)
    return report["accuracy"]


def plot(rows: list[dict], teacher_acc: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    evals = [r for r in rows if "accuracy" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", color="tab:red",
            label="student, greedy held-out accuracy")
    ax.axhline(teacher_acc, color="tab:blue", linestyle="--", label=f"teacher ({teacher_acc:.3f})")
    ax.set(xlabel="distillation step", ylabel="accuracy", ylim=(-0.02, 1.02),
           title="On-policy distillation of the calculator teacher")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    teacher_dir = train_teacher(args, out)
    t_teacher = time.time() - t0

    seed_everything(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(TINY_CALC)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(TINY_CALC, dtype=torch.float32)  # the fresh copy
    disable_dropout(student)
    env = ToolUseEnv([calculator], custom_sys_prompt=SYSTEM_PROMPT, max_turns=2)
    reward_fn = BoxedReward()
    train_rows, held_out = load_data(None, args.eval_size, args.seed)
    distill = Distill(student, tokenizer, teacher=teacher)  # reverse KL to the teacher, nothing else
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)

    teacher_acc = held_out_accuracy(teacher, tokenizer, env, reward_fn, held_out, args, 0)
    rows = [{"step": 0, "accuracy": held_out_accuracy(student, tokenizer, env, reward_fn, held_out, args, 0)}]
    print(f"teacher held-out accuracy {teacher_acc:.3f}; student at step 0: {rows[0]['accuracy']:.3f}", flush=True)
    t1 = time.time()
    for step in range(1, args.distill_steps + 1):
        batch = batch_at(train_rows, (step - 1) * args.batch_size, args.batch_size, args.seed + 1)
        student.eval()
        gen = ModelGenerate(student, tokenizer, max_new_tokens=args.max_new_tokens, temperature=1.0,
                            tool_call_stop=env.stop_strings, seed=args.seed * 1000 + step)
        rollouts = collect_rollouts(gen, env, [r["question"] for r in batch], [r["answer"] for r in batch],
                                    group_size=args.group_size)
        student.train()
        loss = distill.calculate_loss(rollouts)
        loss.backward()
        grad_norm = clipped_step(optimizer, max_grad_norm=1.0)
        row = {"step": step, "reverse_kl": float(distill.metrics["reverse_kl"]), "grad_norm": float(grad_norm),
               "reward": float(reward_fn(rollouts, [r.metadata["answer"] for r in rollouts]).mean())}
        if step % args.eval_every == 0 or step == args.distill_steps:
            row["accuracy"] = held_out_accuracy(student, tokenizer, env, reward_fn, held_out, args, step)
            print(f"[step {step}] reverse KL {row['reverse_kl']:.3f}  student held-out accuracy "
                  f"{row['accuracy']:.3f} (teacher {teacher_acc:.3f})", flush=True)
        rows.append(row)
    t_distill = time.time() - t1
    with open(out / "distill.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    plot(rows, teacher_acc, out / "distill_curve.png")
    final = rows[-1]["accuracy"]
    summary = {"teacher_accuracy": teacher_acc, "student_start": rows[0]["accuracy"], "student_final": final,
               "teacher_seconds": round(t_teacher), "distill_seconds": round(t_distill)}
    print(f"\nstudent held-out accuracy {rows[0]['accuracy']:.3f} -> {final:.3f} in {args.distill_steps} steps "
          f"(teacher {teacher_acc:.3f}); teacher {t_teacher:.0f} s, distillation {t_distill:.0f} s; "
          f"{out / 'distill_curve.png'}", flush=True)
    return summary


if __name__ == "__main__":
    main()
