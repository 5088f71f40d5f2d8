"""Generation throughput: a per-rollout loop vs one batched call, on a tiny random Qwen2 (CPU by default).

    uv run python benchmarks/generation.py                 # batch 1, 8, 32; 32 new tokens; hidden 128; 1 thread
    uv run python benchmarks/generation.py --threads 2     # torch CPU threads (0: torch's default)
    uv run python benchmarks/generation.py --batches 1 8 32 --new-tokens 64 --device cuda

Tokens/s counts the ids actually sampled (a rollout may stop early at EOS). The default of one
CPU thread keeps the numbers meaningful on a shared machine, where OpenMP threads that compete
with other processes spin and swamp the measurement.
"""

from __future__ import annotations

import argparse
import time

import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.model.generate import ModelGenerate
from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer

QUESTIONS = [
    "What is 12 + 35?", "How many apples are left?", "def f(x): return x ** 2 + 1. What is f(3)?",
    "The quick brown fox jumps over the lazy dog. Why?", "Let me think step by step: 7 * 8 = ?",
    "Answer the question.", "What is 100 - 1?", "Use the calculator tool for 3 * (4 + 5).",
]


def make_rollouts(n: int) -> list[Rollout]:
    return [Rollout([Message("You are a helpful assistant.", MessageType.SYSTEM),
                     Message(QUESTIONS[i % len(QUESTIONS)])]) for i in range(n)]


def timed(fn) -> tuple[float, int]:
    start = time.perf_counter()
    msgs = fn()
    return time.perf_counter() - start, sum(len(m.token_ids) for m in msgs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("generation.py: CUDA is not available, nothing measured (run it on a machine with a GPU, "
              "or use --device cpu).")
        return
    if args.threads:
        torch.set_num_threads(args.threads)

    tok = tiny_tokenizer("chatml")
    model = tiny_model("qwen2", tok, hidden_size=args.hidden, num_layers=args.layers).to(args.device)
    gen = ModelGenerate(model, tok, max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    gen.generate(make_rollouts(2))  # warm-up

    print(f"tiny qwen2 hidden={args.hidden} layers={args.layers} vocab={len(tok)} device={args.device} "
          f"threads={torch.get_num_threads()} max_new_tokens={args.new_tokens}")
    print(f"{'batch':>5} | {'loop tok/s':>10} | {'batched tok/s':>13} | {'speedup':>7}")
    for b in args.batches:
        rollouts = make_rollouts(b)
        t_loop, n_loop = timed(lambda rs=rollouts: [gen.rollout_generate_response(r) for r in rs])
        t_batch, n_batch = timed(lambda rs=rollouts: [g[0] for g in gen.generate(rs)])
        loop, batched = n_loop / t_loop, n_batch / t_batch
        print(f"{b:>5} | {loop:>10.0f} | {batched:>13.0f} | {batched / loop:>6.1f}x")


if __name__ == "__main__":
    main()
