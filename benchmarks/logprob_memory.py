"""Peak memory and time of token log-probs + a policy-gradient loss + backward.

Three variants on random final hidden states with a Qwen2.5-0.5B-sized output
head (vocab 151,936, hidden 896) by default, loss = -mean(logp * advantage):

    naive    log_softmax(lm_head(h).float()).gather(...), autograd
    chunked  logprobs_from_hidden (chunks; backward recomputes each chunk's logits)
    fused    fused_token_loss (chunks; gradients chained during the forward, what GRPO uses)

Time is the fastest of `--repeats` steps, in wall seconds and in CPU seconds
(`process_time`, which does not count waiting for a shared core: use it with
`--threads 1` on a loaded machine). Each variant runs in a FRESH subprocess; peak memory is the process's resident
set high-water mark (`resource.getrusage(RUSAGE_SELF).ru_maxrss`), which sees
torch's allocations (tracemalloc does not). `setup` is the high-water mark after
allocating the head, its gradient buffer and the inputs; `extra` = peak - setup
is what the log-prob computation itself added.

    uv run python benchmarks/logprob_memory.py                      # 4,096 tokens, trainable head
    uv run python benchmarks/logprob_memory.py --frozen-head        # LoRA-style frozen lm_head
    uv run python benchmarks/logprob_memory.py --tokens 512 --repeats 1   # quick check
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

VARIANTS = ("naive", "chunked", "fused")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(args) -> dict:
    import torch
    from torch import nn

    from SimpleTorchLLMRL.model.scoring.logprobs import fused_token_loss, logprobs_from_hidden

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    head = nn.Linear(args.hidden, args.vocab, bias=False)
    head.weight.requires_grad_(not args.frozen_head)
    if not args.frozen_head:
        head.weight.grad = torch.zeros_like(head.weight)  # both variants pay for the weight gradient up front
    h = torch.randn(args.tokens, args.hidden, requires_grad=True)
    y = torch.randint(0, args.vocab, (args.tokens,))
    adv = torch.randn(args.tokens)
    setup = _rss_mb()

    def step():
        if args.variant == "fused":
            loss, _, _ = fused_token_loss(h, head, y, lambda lp, sl: -lp * adv[sl] / len(adv),
                                          chunk_size=args.chunk_size)
        else:
            if args.variant == "naive":
                logp = torch.log_softmax(head(h).float(), dim=-1).gather(1, y[:, None]).squeeze(1)
            else:
                logp, _ = logprobs_from_hidden(h, head, y, chunk_size=args.chunk_size)
            loss = -(logp * adv).mean()
        loss.backward()
        return loss.item()

    times, cpu = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"variant": args.variant, "setup_mb": setup, "peak_mb": _rss_mb(), "time_s": min(times),
            "times_s": times, "cpu_s": min(cpu), "cpus_s": cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2, help="timed steps per variant (min is reported)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--frozen-head", action="store_true", help="lm_head frozen (LoRA): only hidden-state grads")
    p.add_argument("--variants", default="naive,chunked,fused", help="comma-separated subset to run")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(child(args)))
        return
    results = []
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", variant]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    head = "frozen" if args.frozen_head else "trainable"
    print(f"vocab={args.vocab} hidden={args.hidden} tokens={args.tokens} chunk_size={args.chunk_size} "
          f"head={head} threads={args.threads} float32 repeats={args.repeats}")
    base = results[0]
    print(f"{'variant':<8} {'peak MB':>9} {'setup MB':>9} {'extra MB':>9} {'time s':>8} {'CPU s':>8} "
          f"{'peak vs ' + base['variant']:>15} {'time vs ' + base['variant']:>15} {'CPU vs ' + base['variant']:>14}")
    for r in results:
        print(f"{r['variant']:<8} {r['peak_mb']:>9.0f} {r['setup_mb']:>9.0f} {r['peak_mb'] - r['setup_mb']:>9.0f} "
              f"{r['time_s']:>8.2f} {r['cpu_s']:>8.2f} {base['peak_mb'] / r['peak_mb']:>14.2f}x "
              f"{r['time_s'] / base['time_s']:>14.2f}x {r['cpu_s'] / base['cpu_s']:>13.2f}x")


if __name__ == "__main__":
    main()
