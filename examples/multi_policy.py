"""Two agents, two policies, one base model: each agent's LoRA adapter trained by GRPO in one plain loop (CPU).

The task is a two-step calculation split between two agents (a cooperative chain):

    user:     What is 437 + 85?                       (a + b)
    planner:  <tool_call> {"name": "calculator", ...}  (agent A, adapter "planner": the sub-step)
    tool:     522
    planner:  \\boxed{522}
    user:     What is 522 - 64?                       (the env writes A's result into B's question)
    finisher: ... \\boxed{458}                         (agent B, adapter "finisher")

Each agent is rewarded for its own step: the planner for boxing a + b, the finisher for boxing
x - c, where x is the number the planner boxed (0 when it boxed none). Both agents sample from
one shared transcript, each with its own adapter (`ModelGenerate(..., adapter=)`); each is trained on the same transcript
with only its own turns in the loss mask (`set_trainable_agents`), its own GRPO groups and
advantages, its adapter active (`use_adapter`), and an optimizer over its adapter only. The KL
term (--beta) is taken to the base model: the adapters switched off.

    uv run python examples/multi_policy.py                      # 60 steps, ~2.5 min on 2 CPU cores
    uv run python examples/multi_policy.py --steps 3 --eval-episodes 16
    uv run python examples/multi_policy.py --frozen finisher    # the finisher keeps its (initial) policy

It ends with each agent's held-out reward before -> after; the curves are in
runs/multi_policy/rewards.png (see docs/multi_policy.md for a measured run).

The embedded tiny_calc model answers additions and subtractions from memory (wrongly) and only
sometimes calls the calculator, so each agent has room to learn its own tool use.

Legend: Q questions per step (--batch-size), G samples per question (--group-size), R = Q * G episodes.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from SimpleTorchLLMRL import GRPO, Message, MessageType, ModelGenerate, Rollout
from SimpleTorchLLMRL.env.multiagent import agent_turns, set_trainable_agents, take_turns
from SimpleTorchLLMRL.model.adapters import (
    adapter_parameters,
    add_agent_adapters,
    freeze_adapter,
    save_adapters,
    use_adapter,
)
from SimpleTorchLLMRL.recipes.calculator import arithmetic as calc
from SimpleTorchLLMRL.testing.tiny import TINY_CALC

AGENTS = ("planner", "finisher")  # agent name == adapter name
TOOLS = [calc.CALCULATOR_SCHEMA]


# ----------------------------------------------------------------------------- the episode


def new_episode(a: int, b: int, c: int, group: int) -> Rollout:
    return Rollout(calc.prompt_messages(f"What is {a} + {b}?"),
                   {"group_id": group, "tools": TOOLS, "a": a, "b": b, "c": c})


def boxed_int(message: Message | None) -> int | None:
    return None if message is None else calc.parse_int(calc.extract_boxed(message.content))


def agent_step(episodes: list[Rollout], agent: str, generator: ModelGenerate, max_turns: int = 2) -> None:
    """`agent` speaks in every episode (sampled with its own adapter); a calculator call is answered
    by a TOOL message and the agent speaks again, up to `max_turns` turns."""
    def respond(rollouts: list[Rollout]) -> list[Message]:
        return [group[0] for group in generator.generate(rollouts, adapter=agent)]

    active = list(episodes)
    for turn in range(max_turns):
        if not active:
            break
        replies = take_turns(active, agent, respond, view=False)  # the shared transcript is the prompt
        still = []
        for episode, reply in zip(active, replies, strict=True):
            expression = calc.parse_tool_call(reply.content)
            if expression is not None and turn + 1 < max_turns:
                episode.add_messages(Message(calc.run_calculator(expression), MessageType.TOOL, name="calculator"))
                still.append(episode)
        active = still


def play(episodes: list[Rollout], generator: ModelGenerate) -> dict[str, torch.Tensor]:
    """The planner, then the finisher on the planner's number; returns each agent's rewards, (R,) each."""
    agent_step(episodes, "planner", generator)
    for e in episodes:  # the env writes the planner's result into the finisher's question (0 if it gave none)
        x = boxed_int(agent_turns(e, "planner")[-1])
        e.metadata["x"] = 0 if x is None else x
        e.add_messages(Message(f"What is {e.metadata['x']} - {e.metadata['c']}?", MessageType.MESSAGE))
    agent_step(episodes, "finisher", generator)
    rewards = {agent: torch.zeros(len(episodes)) for agent in AGENTS}
    for i, e in enumerate(episodes):
        m = e.metadata
        rewards["planner"][i] = float(boxed_int(agent_turns(e, "planner")[-1]) == m["a"] + m["b"])
        rewards["finisher"][i] = float(boxed_int(agent_turns(e, "finisher")[-1]) == m["x"] - m["c"])
    return rewards


def problems(rng: random.Random, n: int, split: str) -> list[tuple[int, int, int]]:
    """(a, b, c): a + b an addition of the arithmetic task's `split` with a sum under 1000 (the tiny
    model never saw 4-digit numbers, so it cannot copy them), c of 2-3 digits."""
    out = []
    while len(out) < n:
        p = calc.random_problem(rng, ops=("+",))
        if p.split == split and p.a + p.b < 1000:
            out.append((p.a, p.b, rng.randint(10, 999)))
    return out


def episodes_for(triples, group_size: int) -> list[Rollout]:
    return [new_episode(a, b, c, g) for g, (a, b, c) in enumerate(triples) for _ in range(group_size)]


def mean_rewards(rewards: dict[str, torch.Tensor]) -> dict[str, float]:
    return {a: r.mean().item() for a, r in rewards.items()}


# ----------------------------------------------------------------------------- the loop


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8, help="questions per step")
    ap.add_argument("--group-size", type=int, default=8, help="episodes per question (each agent's GRPO group)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank of each agent's adapter")
    ap.add_argument("--beta", type=float, default=0.02, help="KL to the base model (adapters off), per agent")
    ap.add_argument("--frozen", nargs="*", default=[], choices=AGENTS,
                    help="agents whose adapter stays fixed (not trained; they still play)")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--eval-episodes", type=int, default=128, help="held-out episodes for before/after")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/multi_policy")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # a 1M-parameter model gains nothing from threads on a shared CPU
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_CALC)
    base = AutoModelForCausalLM.from_pretrained(TINY_CALC, dtype=torch.float32)
    model = add_agent_adapters(base, AGENTS, r=args.rank, alpha=2 * args.rank)  # one adapter per agent
    generator = ModelGenerate(model, tokenizer, max_new_tokens=args.max_new_tokens, temperature=1.0,
                              tool_call_stop=["</tool_call>"], seed=args.seed)
    trained = [a for a in AGENTS if a not in args.frozen]
    for agent in args.frozen:
        freeze_adapter(model, agent)  # a fixed policy: it plays, nothing trains it
    grpo = {a: GRPO(model, tokenizer, beta=args.beta, temperature=1.0) for a in trained}
    optimizers = {a: torch.optim.AdamW(adapter_parameters(model, a), lr=args.lr) for a in trained}

    held_out = problems(random.Random(args.seed + 1), args.eval_episodes, "test")

    def evaluate() -> dict[str, float]:
        eval_gen = ModelGenerate(model, tokenizer, max_new_tokens=args.max_new_tokens, temperature=1.0,
                                 tool_call_stop=["</tool_call>"], seed=12345)
        return mean_rewards(play(episodes_for(held_out, 1), eval_gen))

    before = evaluate()
    print(f"held-out reward before: {json.dumps({a: round(v, 3) for a, v in before.items()})}")
    rng, history = random.Random(args.seed), []
    for step in range(1, args.steps + 1):
        episodes = episodes_for(problems(rng, args.batch_size, "train"), args.group_size)  # R
        rewards = play(episodes, generator)  # {agent: (R,)}
        row = {"step": step}
        for agent in AGENTS:
            row[f"{agent}/reward"] = rewards[agent].mean().item()
            row[f"{agent}/tool_rate"] = sum(
                any(calc.parse_tool_call(m.content) for m in agent_turns(e, agent)) for e in episodes) / len(episodes)
            if agent not in trained:
                continue
            batch = [set_trainable_agents(e.copy(), agent) for e in episodes]  # only its turns are trained
            with use_adapter(model, agent):  # its policy; the KL reference is the base (adapters off)
                loss = grpo[agent].calculate_loss(batch, rewards[agent])  # its own groups (metadata["group_id"])
                loss.backward()
            torch.nn.utils.clip_grad_norm_(adapter_parameters(model, agent), 1.0)
            optimizers[agent].step()
            optimizers[agent].zero_grad(set_to_none=True)
            row[f"{agent}/loss"] = loss.item()
            row[f"{agent}/kl"] = grpo[agent].metrics.get("kl", 0.0)
        row["seconds"] = round(time.time() - start, 1)
        history.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    after = evaluate()
    with open(out / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in history)
    save_adapters(model, out / "adapters")
    plot(history, before, after, out / "rewards.png")
    seconds = time.time() - start
    print("an episode of the last step:\n" + "\n".join(
        f"  [{m.name or m.role}] {m.content[:100]!r}" for m in episodes[0].messages[1:]))
    print(f"done in {seconds:.0f} s; curves in {out / 'rewards.png'}, adapters in {out / 'adapters'}")
    print("held-out reward before -> after: " + ", ".join(f"{a} {before[a]:.3f} -> {after[a]:.3f}" for a in AGENTS))
    return {"before": before, "after": after, "history": history, "seconds": seconds}


def plot(history: list[dict], before: dict, after: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in history]
    for agent, color in zip(AGENTS, ("tab:blue", "tab:orange"), strict=True):
        ax.plot(steps, [r[f"{agent}/reward"] for r in history], color=color, alpha=0.8,
                label=f"{agent} (held-out {before[agent]:.2f} -> {after[agent]:.2f})")
        ax.plot(steps, [r[f"{agent}/tool_rate"] for r in history], color=color, alpha=0.4, linestyle=":",
                label=f"{agent} tool-use rate")
    ax.set(xlabel="step", ylabel="mean reward of the step's episodes", ylim=(-0.02, 1.02),
           title="two agents, one adapter each, one loop")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
