"""Router-R1 on HendrycksMath: a Qwen policy routes sub-problems to a Qwen tool model (or a calculator).

    uv run python examples/router_r1_math_qwen.py                   # needs the HF hub, a GPU and `datasets`
    uv run python examples/router_r1_math_qwen.py --data math.jsonl # rows with "problem" and "solution"
    uv run python examples/router_r1_math_qwen.py --dry-run         # offline, CPU: tiny models, built-in rows

The pool: `Qwen2.5-7B-Instruct` (a local HF model, loaded on its first call, priced like the
original's table at 0.3 $ per 1M tokens) and `calculator` (exact arithmetic, 0.0001 $ a call).
Rewards use `reward_metric="math"` (`math_equal` on the <answer>), minus cost_coefficient x cost.
Settings follow the original train.sh (PPO with GAE, lr 1e-6 / 1e-5, max_turns 4, ...).

`--dry-run` runs the same code path on tiny local models: config validation, the data
pipeline (gold extraction from \\boxed{}, prompts, the max_start_length filter), a lazily
loaded HF tool model from a path, one validation pass and one PPO step. No network, no GPU.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from SimpleTorchLLMRL.recipes.router_r1 import (
    CallableModel,
    HFModel,
    LocalGenerator,
    OpenAIModel,
    RouterR1Trainer,
    RouterTrainingConfig,
    RoutingPool,
    load_rows,
)
from SimpleTorchLLMRL.reward import extract_boxed
from SimpleTorchLLMRL.tools import evaluate

SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
            "prealgebra", "precalculus")

# A few MATH-style rows for --dry-run (same fields as the hub dataset).
SAMPLE = [
    {"problem": "What is $3 \\cdot 7 + 5$?", "solution": "$3 \\cdot 7 = 21$, so the sum is $\\boxed{26}$."},
    {"problem": "Simplify $\\frac{6}{8}$.", "solution": "Divide by 2: $\\boxed{\\frac{3}{4}}$."},
    {"problem": "Solve $2x - 4 = 10$.", "solution": "$2x = 14$, so $x = \\boxed{7}$."},
    {"problem": "What is $-2.5 + 1$?", "solution": "The sum is $\\boxed{-1.5}$."},
    {"problem": "How many positive divisors does 12 have?", "solution": "1,2,3,4,6,12: $\\boxed{6}$."},
    {"problem": "Compute $2^{5}$.", "solution": "$2^5 = \\boxed{32}$."},
    {"problem": "What is $15\\%$ of 40?", "solution": "$0.15 \\cdot 40 = \\boxed{6}$."},
    {"problem": "Evaluate $\\sqrt{49}$.", "solution": "$\\boxed{7}$"},
]


def math_rows(records) -> list[dict]:
    """HendrycksMath records -> Router-R1 rows; records whose solution has no \\boxed{} answer are skipped."""
    rows = []
    for rec in records:
        gold = extract_boxed(rec["solution"])
        if gold is not None:
            rows.append({"question": rec["problem"], "golden_answers": [gold]})
    return rows


def load_math(split: str, subjects) -> list[dict]:
    try:
        from datasets import load_dataset
    except ImportError as e:
        raise ImportError("loading HendrycksMath from the hub needs the `datasets` package "
                          "(uv pip install datasets), or pass --data FILE.jsonl with problem/solution fields") from e
    records = []
    for subject in subjects:
        records += list(load_dataset("EleutherAI/hendrycks_math", subject, split=split))
    return math_rows(records)


def make_pool(tool_path: str, config: RouterTrainingConfig, device: str | None) -> RoutingPool:
    t = config.tool
    remote = []  # the original's API pool: an OpenAI-compatible server, key from $ROUTER_API_KEY
    if t.api_base is not None:
        remote = [OpenAIModel.from_config("LLaMA-3.1-70B-Instruct", "meta/llama-3.1-70b-instruct", t,
                                          price_per_1m_tokens=0.88, description="large general model (remote API)")]
    qwen = LocalGenerator(tool_path, max_new_tokens=t.routed_max_tokens, temperature=t.routed_temperature,
                          device=device, dtype="bfloat16" if device == "cuda" else "float32")
    return RoutingPool.from_config([
        HFModel("Qwen2.5-7B-Instruct", generator=qwen, price_per_1m_tokens=0.3,
                description="strong at mathematics, reasoning and coding; slower and priced per token"),
        CallableModel("calculator", lambda q: str(evaluate(q)), cost_per_call=1e-4,
                      description="evaluates one arithmetic expression exactly, e.g. 3*(4+5)"),
        *remote,
    ], t)


def build_config(args, output_dir: str) -> RouterTrainingConfig:
    base = [  # train.sh, adapted: math answers, one GPU
        "data.train_batch_size=64", "data.val_batch_size=64", "data.max_prompt_length=4096",
        "data.max_response_length=1024", "data.max_start_length=2048", "data.max_obs_length=600",
        f"data.train_data_num={args.train_num}", f"data.val_data_num={args.val_num}",
        "generation.max_turns=4", "generation.temperature=1.0", f"generation.n_agent={args.n_agent}",
        "reward.reward_metric='math'", f"reward.cost_coefficient={args.cost_coefficient}",
        f"trainer.adv_estimator={'grpo' if args.algo == 'grpo' else 'gae'}", "trainer.critic='model'",
        "trainer.actor_lr=1e-6", "trainer.critic_lr=1e-5", "trainer.kl_coef=0.001",
        "trainer.ppo_mini_batch_size=32", "trainer.ppo_micro_batch_size=8", "trainer.save_freq=15",
        "validation.test_freq=15", f"trainer.total_training_steps={args.steps}",
        f"trainer.default_local_dir={output_dir!r}", "trainer.experiment_name='router-r1-math-qwen'",
        f"trainer.logger={('console', 'wandb') if args.wandb else ('console',)}",
        f"tool.api_base={args.api_base!r}",
    ]
    if args.dry_run:  # tiny sizes, same pipeline
        base += ["data.train_batch_size=2", "data.val_batch_size=4", "data.max_prompt_length=700",
                 "data.max_response_length=16", "data.max_start_length=600", "data.max_obs_length=16",
                 "tool.routed_max_tokens=8", "generation.max_turns=1", "trainer.ppo_mini_batch_size=4",
                 "trainer.ppo_micro_batch_size=2", "trainer.total_training_steps=1", "trainer.save_freq=-1",
                 "validation.test_freq=-1", "trainer.actor_lr=1e-4", "trainer.critic_lr=1e-3"]
    return RouterTrainingConfig.from_overrides(base)


def load_models(args, device: str):
    if args.dry_run:
        from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer

        tok = tiny_tokenizer("chatml")
        tool_dir = tempfile.mkdtemp(prefix="router_r1_tiny_tool_")
        tiny_model("qwen2", tok, seed=1, max_position_embeddings=1024).save_pretrained(tool_dir)  # loaded lazily
        tok.save_pretrained(tool_dir)
        return tiny_model("qwen2", tok, seed=0, max_position_embeddings=1024).train(), tok, tool_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.policy)
    policy = AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.bfloat16).to(device)
    policy.gradient_checkpointing_enable()
    return policy.train(), tok, args.tool_model


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="Qwen/Qwen2.5-3B-Instruct")
    p.add_argument("--tool-model", default="Qwen/Qwen2.5-7B-Instruct")
    p.add_argument("--data", default=None, help="jsonl with problem/solution rows (default: the hub dataset)")
    p.add_argument("--subjects", default=",".join(SUBJECTS))
    p.add_argument("--algo", choices=("ppo", "grpo"), default="ppo")
    p.add_argument("--n-agent", type=int, default=1)
    p.add_argument("--steps", type=int, default=225)
    p.add_argument("--train-num", default="None", help="rows sampled from the training split (None: all)")
    p.add_argument("--val-num", default="500")
    p.add_argument("--cost-coefficient", type=float, default=0.0)
    p.add_argument("--output-dir", default="checkpoints/router_r1_math")
    p.add_argument("--api-base", default=None, help="OpenAI-compatible server (…/v1) adding a remote model; "
                   "the key is read from $ROUTER_API_KEY")
    p.add_argument("--wandb", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="offline check on tiny models and built-in rows")
    args = p.parse_args(argv)
    start = time.perf_counter()
    if args.dry_run:
        args.train_num, args.val_num, args.steps = "None", "None", 1
        args.output_dir = tempfile.mkdtemp(prefix="router_r1_math_dry_")
        args.n_agent = max(args.n_agent, 2)
        torch.set_num_threads(1)
    config = build_config(args, args.output_dir)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if not args.dry_run and device != "cuda":
        p.error("the full run needs a CUDA GPU; use --dry-run to check the pipeline on CPU")
    if args.dry_run:
        train_rows, val_rows = math_rows(SAMPLE[:4]), math_rows(SAMPLE[4:])
    elif args.data:
        rows = math_rows(load_rows([args.data]))
        train_rows, val_rows = rows[: int(0.9 * len(rows))], rows[int(0.9 * len(rows)):]
    else:
        subjects = args.subjects.split(",")
        train_rows, val_rows = load_math("train", subjects), load_math("test", subjects)
    policy, tok, tool_path = load_models(args, device)
    pool = make_pool(tool_path, config, device)
    trainer = RouterR1Trainer(config, policy, tok, pool, train_rows, val_rows)
    print(f"[math] {len(trainer.train_rows)} train / {len(trainer.val_rows)} val rows; pool: {pool.names}")
    if args.dry_run:
        assert [r.answer for r in trainer.val_rows] == [["6"], ["32"], ["6"], ["7"]], trainer.val_rows
        val = trainer.validate()
        train = trainer.train_step(trainer.train_rows[: config.data.train_batch_size])
        routed = pool.route([("qwen2.5-7b-instruct", "What is 2 + 2?"), ("calculator", "3 * (4 + 5)")])
        assert [r.status for r in routed] == ["ok", "ok"] and routed[1].text == "27", routed
        print(f"[math] validation: {val}\n[math] one step: reward={train['train/reward']:.3f} "
              f"loss={train.get('train/loss', float('nan')):.4f}; pool check: {[r.text[:30] for r in routed]} "
              f"(tool model loaded from its path: {pool.get('Qwen2.5-7B-Instruct').generator.loaded})")
        print(f"[math] dry run ok in {time.perf_counter() - start:.1f}s")
        return {"val": val, "train": train}
    result = trainer.fit()
    print(f"[math] done in {time.perf_counter() - start:.1f}s: {result['val']}")
    return result


if __name__ == "__main__":
    main()
