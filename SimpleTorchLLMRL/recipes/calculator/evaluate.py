"""Held-out evaluation for `main.py`: greedy accuracy, pass@k, tool use; rollouts rendered as text.

Legend: P problems, k samples per problem.

    report, rollouts = evaluate(model, tokenizer, env, reward_fn, held_out, k=4, k_problems=50, seed=0)
    report["accuracy"], report[f"pass@{4}"]
    print(summary_table(read_metrics("metrics.jsonl")))
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from SimpleTorchLLMRL.chat.message import MessageType, Rollout
from SimpleTorchLLMRL.env.rollouts import collect_rollouts
from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
from SimpleTorchLLMRL.recipes.calculator.arithmetic import used_tool
from SimpleTorchLLMRL.recipes.calculator.train_loop import episode_stats


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@torch.no_grad()
def evaluate(model, tokenizer, env, reward_fn, rows: Sequence[dict], *, k: int, k_problems: int, seed: int,
             temperature: float = 1.0, max_new_tokens: int = 40, max_turns: int | None = None,
             engine=None) -> tuple[dict[str, float], list[Rollout]]:
    """Greedy accuracy on every row, pass@k at `temperature` on the first `k_problems`; returns (report, greedy
    rollouts). engine: a `vllm.LLM` to generate with instead of the HF model (its weights must be current)."""
    questions = [r["question"] for r in rows]
    answers = [r["answer"] for r in rows]
    greedy = ModelGenerate(engine if engine is not None else model, tokenizer, seed=seed,
                           sampling=SamplingConfig(max_new_tokens=max_new_tokens, do_sample=False,
                                                   tool_call_stop=env.stop_strings))
    rollouts = collect_rollouts(greedy, env, questions, answers, group_size=1, max_turns=max_turns)
    rewards = reward_fn(rollouts, answers)  # (P,)
    report = {f"greedy_{key}": v for key, v in episode_stats(rollouts, rewards).items()}
    report["accuracy"] = report.pop("greedy_accuracy")
    if k_problems > 0:
        sub_q, sub_a = questions[:k_problems], answers[:k_problems]
        sampler = ModelGenerate(engine if engine is not None else model, tokenizer, max_new_tokens=max_new_tokens,
                                temperature=temperature, tool_call_stop=env.stop_strings, seed=seed)
        sampled = collect_rollouts(sampler, env, sub_q, sub_a, group_size=k, max_turns=max_turns)
        correct = (reward_fn(sampled, [a for a in sub_a for _ in range(k)]) >= 1.0).view(len(sub_q), k)  # (P, k)
        report[f"pass@{k}"] = sum(pass_at_k(k, int(c), k) for c in correct.sum(1)) / len(sub_q)
        report["sampled_accuracy"] = float(correct.float().mean())
        report["sampled_tool_rate"] = sum(map(used_tool, sampled)) / len(sampled)
    return report, rollouts


def render_rollout(rollout: Rollout, reward: float | None = None, show_system: bool = False) -> str:
    """A rollout as readable text: one block per message, then the answer and the reward."""
    lines = []
    for m in rollout:
        if m.type is MessageType.SYSTEM and not show_system:
            continue
        label = m.role + (f" ({m.name})" if m.name else "")
        if m.type is MessageType.MODEL and m.finish_reason:
            label += f" [{m.finish_reason}]"
        lines.append(f"[{label}]\n{m.content}")
    answer = rollout.metadata.get("answer")
    tail = [f"expected: {answer}"] if answer is not None else []
    if reward is not None:
        tail.append(f"reward: {reward:g}")
    return "\n".join(lines + (["-- " + ", ".join(tail)] if tail else []))


def render_rollouts(rollouts: Sequence[Rollout], rewards: Sequence[float] | None = None, title: str = "") -> str:
    """Several rollouts, separated by rules; the system prompt is shown once at the top."""
    rewards = list(rewards) if rewards is not None else [None] * len(rollouts)
    head = [f"# {title}"] if title else []
    system = next((m.content for m in rollouts[0] if m.type is MessageType.SYSTEM), None) if rollouts else None
    if system:
        head.append(f"[system prompt of every rollout]\n{system}")
    blocks = [f"## rollout {i}\n{render_rollout(r, w)}" for i, (r, w) in enumerate(zip(rollouts, rewards,
                                                                                        strict=True))]
    return "\n\n".join(head + blocks) + "\n"


def summary_table(rows: Sequence[dict], k: int) -> str:
    """Markdown table of every evaluation row (those with "eval/accuracy") in a metrics log."""
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    cols = [("step", "step"), ("eval/accuracy", "greedy acc"), (f"eval/pass@{k}", f"pass@{k}"),
            ("eval/sampled_accuracy", "sampled acc"), ("eval/greedy_tool_rate", "greedy tool use")]
    out = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in evals:
        cells = [str(r["step"])] + [f"{r[key]:.3f}" if isinstance(r.get(key), float) else "-" for key, _ in cols[1:]]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def accuracy_change(rows: Sequence[dict], steps: int) -> str | None:
    """"held-out greedy accuracy: first -> last (+x points) after N steps", None without evaluations."""
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    if not evals:
        return None
    first, final = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    return (f"held-out greedy accuracy: {first:.3f} -> {final:.3f} ({(final - first) * 100:+.1f} points) "
            f"after {steps} steps")
