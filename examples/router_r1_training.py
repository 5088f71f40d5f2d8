"""Router-R1 offline toy: a tiny policy learns to route arithmetic to a pool of local "LLMs".

    uv run python examples/router_r1_training.py                  # PPO, CPU, no network
    uv run python examples/router_r1_training.py --algo grpo --steps 4

The pool: `calculator` (exact, Python callable, 0.01 $ a call), `guesser` (a callable
that answers a wrong number, 0.001 $), and two names served by ONE shared tiny HF model
(`tiny-a`, `tiny-b`). The policy is a random-init tiny Qwen2 from `SimpleTorchLLMRL.testing.tiny`;
`--warmup-steps` of supervised warm-up on scripted episodes teach it the tag format first
(think -> search -> information -> answer), so that PPO starts from well-formed rollouts.
Everything (warm-up, training, validation) runs on CPU in under 2 minutes.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from SimpleTorchLLMRL import Message, MessageType, Rollout, rollouts_to_batch
from SimpleTorchLLMRL.model.dropout import disable_dropout
from SimpleTorchLLMRL.recipes.router_r1 import (
    CallableModel,
    HFModel,
    LocalGenerator,
    RouterR1Trainer,
    RouterTrainingConfig,
    RoutingPool,
)
from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer
from SimpleTorchLLMRL.tools import evaluate

TOY_PROMPT = "Models: {models}\nQuestion: {question}\n"


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"question": f"{a} + {b}", "golden_answers": [str(a + b)]})
    return rows


def make_pool(tokenizer) -> RoutingPool:
    shared = LocalGenerator(model=tiny_model("qwen2", tokenizer, seed=7), tokenizer=tokenizer, max_new_tokens=6)
    return RoutingPool([
        CallableModel("calculator", lambda q: str(evaluate(q)), cost_per_call=0.01, description="exact arithmetic"),
        CallableModel("guesser", lambda q: "7", cost_per_call=0.001, description="cheap, often wrong"),
        HFModel("tiny-a", generator=shared, price_per_1m_tokens=100.0, description="a tiny LM"),
        HFModel("tiny-b", generator=shared, price_per_1m_tokens=50.0, description="the same tiny LM"),
    ])


def demonstration(row: dict, prompt: str) -> Rollout:
    """A scripted well-formed episode: think, ask the calculator, read, answer."""
    q, gold = row["question"], row["golden_answers"][0]
    return Rollout([
        Message(prompt),
        Message(f"<think>add</think><search>calculator: {q}</search>", MessageType.MODEL),
        Message(f"\n\n<information>{gold}</information>\n\n", MessageType.TOOL),
        Message(f"<think>ok</think><answer>{gold}</answer>", MessageType.MODEL),
    ])


def warm_up(policy, tokenizer, rows, env, steps: int, lr: float, batch_size: int = 8) -> float:
    """Supervised warm-up: cross-entropy on the MODEL tokens of scripted episodes. Returns the last loss."""
    if steps <= 0:
        return float("nan")
    demos = [demonstration(r, env.prompt(r["question"])) for r in rows]
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    policy.train()
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        batch = rollouts_to_batch([demos[(step * batch_size + i) % len(demos)] for i in range(batch_size)], tokenizer)
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]  # (B, T-1, V)
        target = batch.input_ids[:, 1:].masked_fill(batch.loss_mask[:, 1:] == 0, -100)  # (B, T-1)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    policy.eval()
    return loss.item()


def build_config(args, output_dir: str) -> RouterTrainingConfig:
    n_agent = 4 if args.algo == "grpo" else 2
    return RouterTrainingConfig.from_overrides([
        f"data.prompt_template={TOY_PROMPT!r}", "data.train_batch_size=4", "data.val_batch_size=8",
        "data.max_prompt_length=200", "data.max_start_length=64", "data.max_response_length=24",
        "data.max_obs_length=16", "generation.max_turns=2", "generation.max_routing_calls=2",
        f"generation.n_agent={n_agent}", "generation.temperature=1.0", "reward.cost_coefficient=1.0",
        "reward.require_think=True", f"trainer.adv_estimator={'grpo' if args.algo == 'grpo' else 'gae'}",
        f"trainer.total_training_steps={args.steps}", "trainer.total_epochs=10", f"trainer.actor_lr={args.lr}",
        "trainer.critic_lr=1e-3", "trainer.ppo_mini_batch_size=8", "trainer.ppo_micro_batch_size=8",
        "trainer.kl_coef=0.0", f"trainer.save_freq={args.steps if args.save else -1}",
        f"trainer.default_local_dir={output_dir!r}", f"trainer.seed={args.seed}",
        f"trainer.logger={('console', 'wandb') if args.wandb else ('console',)}",
        f"validation.test_freq={args.steps}", "validation.num_examine=1",
    ])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algo", choices=("ppo", "grpo"), default="ppo")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--warmup-lr", type=float, default=3e-3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=None)
    p.add_argument("--save", action="store_true", help="write a checkpoint at the end")
    p.add_argument("--wandb", action="store_true", help="also log to W&B (offline mode)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest for a tiny model)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="router_r1_toy_")
    config = build_config(args, output_dir)
    tokenizer = tiny_tokenizer("chatml")
    policy = disable_dropout(tiny_model("qwen2", tokenizer, seed=args.seed))
    pool = make_pool(tokenizer)
    train_rows, val_rows = make_rows(32, args.seed), make_rows(8, args.seed + 1)
    trainer = RouterR1Trainer(config, policy, tokenizer, pool, train_rows, val_rows)
    loss = warm_up(policy, tokenizer, train_rows, trainer.env, args.warmup_steps, args.warmup_lr)
    print(f"[toy] warm-up: {args.warmup_steps} steps, last loss {loss:.3f} ({time.perf_counter() - start:.1f}s)")
    before = trainer.validate()
    print("[toy] before RL: " + " ".join(f"{k}={v:.3f}" for k, v in before.items()))
    result = trainer.fit()
    after = result["val"]
    print("[toy] after RL:  " + " ".join(f"{k}={v:.3f}" for k, v in after.items()))
    print(f"[toy] done in {time.perf_counter() - start:.1f}s; outputs in {output_dir}")
    return {"before": before, "after": after, "train": result["train"]}


if __name__ == "__main__":
    main()
