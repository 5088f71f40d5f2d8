"""What `GRPO(share_prefix=True)` saves at a GRPO-like shape: one training forward + backward, shared vs plain.

Legend: U prompts, G completions per prompt, P prompt tokens, N completion tokens, H hidden size.

A random-init Qwen2 with the Qwen2.5-0.5B layer shape (hidden 896, 14/2 heads, intermediate 4864)
and --layers layers runs the U x G rows (P + N tokens each) through `shared_hidden_states`, then a
loss on the completion positions' hidden states, then backward: once with every row running its
whole sequence, once with each prompt run once (`start=`). Reported per variant: CPU seconds
(median of --repeats), the bytes autograd saves for backward (parameters excluded), and the
largest gradient difference between the two (relative to the gradient's largest entry).

    uv run python benchmarks/shared_prefix.py                       # U=2, G=8, P=512, N=128, 4 layers
    uv run python benchmarks/shared_prefix.py --prompt-tokens 128 --group 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from SimpleTorchLLMRL.model.scoring.shared_prefix import shared_hidden_states


def saved_bytes_and_seconds(model, ids, mask, start, w, needed) -> tuple[int, float, dict]:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set = set()

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key[0] not in params:
            seen.add(key)
        return t

    model.zero_grad(set_to_none=True)
    t0 = time.process_time()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = shared_hidden_states(model, ids, mask, start=start, verify=False)  # (B, T, H)
        loss = (h * w * needed).sum()
    loss.backward()
    seconds = time.process_time() - t0
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return sum(n for _, n in seen), seconds, grads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--completion-tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32_000, hidden_size=896, intermediate_size=4864, num_hidden_layers=a.layers,
                      num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(cfg).train()
    U, G, P, N = a.prompts, a.group, a.prompt_tokens, a.completion_tokens
    prompt = torch.randint(0, cfg.vocab_size, (U, P)).repeat_interleave(G, 0)  # (B, P)
    ids = torch.cat([prompt, torch.randint(0, cfg.vocab_size, (U * G, N))], 1)  # (B, P + N)
    mask = torch.ones_like(ids)
    start = torch.full((U * G,), P - 1)  # the last prompt position predicts the first completion token
    needed = (torch.arange(P + N)[None, :, None] >= P - 1).float()  # (1, T, 1)
    w = torch.randn(U * G, P + N, cfg.hidden_size)
    shared_hidden_states(model, ids, mask, start=start)  # warm-up, and the once-per-model check
    rows = {}
    for name, s in (("plain", None), ("shared", start)):
        runs = [saved_bytes_and_seconds(model, ids, mask, s, w, needed) for _ in range(a.repeats)]
        rows[name] = (runs[0][0], statistics.median(r[1] for r in runs), runs[0][2])
    err = max(float((rows["shared"][2][n] - g).abs().max() / g.abs().max()) for n, g in rows["plain"][2].items())
    print(f"{U} prompts x {G} completions, {P} prompt + {N} completion tokens, {a.layers} layers of "
          f"Qwen2.5-0.5B's shape, float32, {a.threads} thread(s), median of {a.repeats}")
    print("| variant | forward + backward CPU s | saved activations MiB |")
    print("|---|---:|---:|")
    for name, (saved, sec, _) in rows.items():
        print(f"| {name} | {sec:.2f} | {saved / 2**20:,.0f} |")
    p, s = rows["plain"], rows["shared"]
    print(f"shared / plain: {s[1] / p[1]:.2f}x time, {s[0] / p[0]:.2f}x saved activations; "
          f"largest gradient difference {err:.1e} of the largest entry")


if __name__ == "__main__":
    main()
