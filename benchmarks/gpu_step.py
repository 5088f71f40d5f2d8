"""GPU section: one GRPO step in bf16 at Qwen2.5-0.5B shapes (random init), full fine-tuning and LoRA.

Legend: B = prompts x group sequences, P prompt tokens, N new tokens, T = P + N, V vocab.

Reports per step: seconds per phase (generate / prepare / loss+backward / optimizer),
generated tokens/s, trained tokens/s, peak CUDA memory, and model-FLOPs utilization
(MFU) of the loss+backward phase against a measured bf16 matmul rate (not the data
sheet): MFU = model FLOPs of the phase / phase seconds / measured matmul FLOP/s.

Model FLOPs per token (forward, dense, this repo's convention): 2 x (attention and MLP
weights) + 2 x H x V (the output head) + 2 x 2 x L x H x T/2 (causal attention
scores). Full fine-tuning trains at 3x forward (forward + activation and weight
gradients); LoRA at 2x forward (forward + activation gradients; the adapters'
own FLOPs are not counted). Generation is reported as tokens/s only (memory-bound).

    uv run python benchmarks/gpu_step.py                  # needs CUDA; exits 0 with a message otherwise
    uv run python benchmarks/gpu_step.py --smoke          # CPU, tiny shapes: checks the code path only

Writes benchmarks/results/gpu_step.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_step.json"

QWEN25_05B = dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32_768,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)


def forward_flops_per_token(cfg: dict, context: float) -> float:
    """Dense forward FLOPs for one token attending to `context` tokens."""
    H, L, V, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["intermediate_size"]
    kv = H // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_layer = 2 * (H * H + 2 * H * kv + H * H + 3 * H * inter) + 2 * 2 * H * context
    return L * per_layer + 2 * H * V


def matmul_rate(device, dtype, n: int = 8192, iters: int = 20) -> float:
    """Measured dense matmul FLOP/s at n x n x n."""
    import torch

    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def build(shape: dict, tokenizer, device, dtype, lora: bool):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**shape, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if lora:
        from SimpleTorchLLMRL.model.lora import apply_lora

        model = apply_lora(model, r=16, alpha=32)
    return model


def grpo_step(model, tokenizer, prompts, args, device, opt, gen, grpo) -> dict:
    import torch

    from SimpleTorchLLMRL.chat.message import Message, Rollout
    from SimpleTorchLLMRL.model.generation.generator import extend_groups

    t = {}
    _sync(device)
    t0 = time.perf_counter()
    base = [Rollout([Message(p)]) for p in prompts]
    rollouts = extend_groups(base, gen.generate(base, n=args.group))
    _sync(device)
    t1 = time.perf_counter()
    tb = grpo.prepare(rollouts, torch.ones(len(rollouts)))  # constant reward: the step's cost does not depend on it
    _sync(device)
    t2 = time.perf_counter()
    model.train()
    loss = grpo.calculate_loss(tb)
    loss.backward()
    _sync(device)
    t3 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(device)
    t4 = time.perf_counter()
    t.update(generate=t1 - t0, prepare=t2 - t1, loss_backward=t3 - t2, optimizer=t4 - t3, total=t4 - t0)
    am = tb.batch.attention_mask
    return {"times": t, "new_tokens": sum(len(r[-1].token_ids) for r in rollouts),
            "tokens": int(am.sum()), "seq_shape": list(tb.batch.input_ids.shape),
            "mean_len": float(am.sum(-1).float().mean())}


def run_case(shape: dict, lora: bool, args, device, dtype, peak: float) -> dict:
    import torch

    from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
    from SimpleTorchLLMRL.testing.tiny import tiny_tokenizer
    from SimpleTorchLLMRL.trainer.grpo import GRPO

    tok = tiny_tokenizer("chatml")
    model = build(shape, tok, device, dtype, lora)
    words = "the quick brown fox jumps over the lazy dog and counts 1 2 3 4 5 6 7 8 9 10".split()
    prompts = [" ".join(words[(i + k) % len(words)] for k in range(args.prompt_words)) for i in range(args.prompts)]
    gen = ModelGenerate(model, tok,
                        sampling=SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0,
                                                eos_token_ids=[shape["vocab_size"] + 7]))  # unreachable: every row runs N tokens
    grpo = GRPO(model, tok, beta=0.0, group_size=args.group, temperature=1.0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0, fused=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    steps = [grpo_step(model, tok, prompts, args, device, opt, gen, grpo) for _ in range(args.warmup + args.steps)]
    timed = steps[args.warmup:]
    med = {k: statistics.median(s["times"][k] for s in timed) for k in timed[0]["times"]}
    s = timed[-1]
    fwd = forward_flops_per_token(shape, s["mean_len"] / 2)
    train_flops = (2 if lora else 3) * fwd * s["tokens"]
    return {
        "lora": lora, "median_s": med, "seq_shape": s["seq_shape"], "trained_tokens": s["tokens"],
        "generated_tokens": s["new_tokens"],
        "generate_tokens_per_s": s["new_tokens"] / med["generate"],
        "train_tokens_per_s": s["tokens"] / med["loss_backward"],
        "step_tokens_per_s": s["tokens"] / med["total"],
        "train_model_tflops": train_flops / med["loss_backward"] / 1e12,
        "mfu_loss_backward": train_flops / med["loss_backward"] / peak,
        "mfu_step": train_flops / med["total"] / peak,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "params": sum(p.numel() for p in model.parameters()),
        "peak_cuda_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, one step: checks the code path only")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    import torch

    if args.smoke:
        device, shape = torch.device("cpu"), TINY
        args.prompts, args.group, args.new_tokens, args.prompt_words = 2, 2, 8, 8
        args.steps, args.warmup = 1, 0
    elif not torch.cuda.is_available():
        print("gpu_step.py: CUDA is not available, nothing measured (run it on a machine with a GPU, "
              "or pass --smoke to check the code path on CPU).")
        sys.exit(0)
    else:
        device, shape = torch.device("cuda"), QWEN25_05B
    dtype = torch.bfloat16
    peak = matmul_rate(device, dtype, n=256 if args.smoke else 8192, iters=2 if args.smoke else 20)
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
           "torch": torch.__version__, "shape": shape, "dtype": "bfloat16",
           "measured_bf16_matmul_tflops": peak / 1e12,
           "workload": {"prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens,
                        "steps": args.steps, "warmup": args.warmup},
           "cases": []}
    for lora in (False, True):
        case = run_case(shape, lora, args, device, dtype, peak)
        out["cases"].append(case)
        m = case["median_s"]
        print(f"{'LoRA r=16' if lora else 'full FT  '}: step {m['total']:.2f} s (generate {m['generate']:.2f}, "
              f"loss+backward {m['loss_backward']:.2f}, optimizer {m['optimizer']:.3f}); "
              f"gen {case['generate_tokens_per_s']:.0f} tok/s, train {case['train_tokens_per_s']:.0f} tok/s, "
              f"MFU(loss+backward) {case['mfu_loss_backward']:.1%}, peak {case['peak_cuda_mem_gib'] or 0:.1f} GiB",
              flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"measured bf16 matmul: {peak / 1e12:.0f} TFLOP/s")
    if not args.smoke:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
