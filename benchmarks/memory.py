"""Peak memory of a GRPO training step: full fine-tune vs LoRA vs QLoRA on one model size.

    uv run python benchmarks/memory.py                       # CPU, a random 120M-parameter Qwen2
    uv run python benchmarks/memory.py --hidden 2048 --layers 16 --device cuda

Each variant runs in a fresh subprocess: load the model, build AdamW over the
trainable parameters, then run `--steps` GRPO steps (chunked log-probs,
backward, optimizer step) on synthetic rollouts; the loss + backward's own peak is reported
apart from the whole step's (which includes AdamW's state). On CPU the step's peak is the
process's RSS high-water mark (VmHWM), reset after loading by writing 5 to
/proc/self/clear_refs, so loading spikes (QLoRA quantizes float weights while
loading) are reported apart; weights are first copied out of the checkpoint's
memory map (see `_materialize`), so RSS counts what the model holds. On CUDA it is torch.cuda.max_memory_allocated.

The checkpoint is a random-init Qwen2 saved to a temporary directory (nothing
is downloaded); QLoRA loads it with 4-bit NF4 + double quantization.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("full", "lora", "qlora")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _rollouts(tokenizer, vocab: int, batch: int, prompt_len: int, response_len: int, group: int, seed: int = 0):
    """Synthetic sampled rollouts: a prompt of tokenizer text, then `response_len` sampled ids."""
    import torch

    from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout

    g = torch.Generator().manual_seed(seed)
    low = len(tokenizer.all_special_ids)
    out = []
    for i in range(batch):
        prompt = tokenizer.decode(torch.randint(low, len(tokenizer), (prompt_len,), generator=g).tolist())
        ids = torch.randint(low, vocab, (response_len,), generator=g).tolist()  # the model's whole vocabulary
        out.append(Rollout([Message(prompt), Message("x", MessageType.MODEL, token_ids=ids)],
                           metadata={"group_id": i // group}))
    return out, torch.rand(batch, generator=g)


def _materialize(model) -> None:
    """Copy memory-mapped weights into private memory, so RSS counts what the model holds.

    On CPU, safetensors loads tensors zero-copy from a memory map of the checkpoint; while any of
    them lives, every checkpoint page ever read stays mapped and counted in RSS, including the
    float weights that QLoRA quantized away. 4-bit weights are already private.
    """
    import gc

    for p in model.parameters():
        if type(p).__name__ != "Params4bit":
            p.data = p.data.clone()
    for m in model.modules():
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = b.clone()
    gc.collect()


def worker(args) -> dict:
    import bitsandbytes  # noqa: F401  (every variant pays the same imports: a common baseline)
    import peft  # noqa: F401
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from SimpleTorchLLMRL.model.lora import apply_lora, load_qlora
    from SimpleTorchLLMRL.trainer.grpo import GRPO

    torch.manual_seed(0)
    baseline_kb = _status_kb("VmRSS")
    cuda = args.device == "cuda"
    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.ckpt)
    t0 = time.time()
    if args.worker == "qlora":
        model = load_qlora(args.ckpt, r=args.rank, alpha=2 * args.rank, compute_dtype=dtype,
                           model_kwargs={"device_map": {"": 0}} if cuda else None)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=dtype).to(args.device)
        if args.worker == "lora":
            model = apply_lora(model, r=args.rank, alpha=2 * args.rank)
    if not cuda:
        _materialize(model)
    load_s = time.time() - t0
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    vocab = model.get_output_embeddings().weight.shape[0]
    rollouts, rewards = _rollouts(tokenizer, vocab, args.batch, args.prompt_len, args.response_len, args.group)
    grpo = GRPO(model, tokenizer, group_size=args.group)
    load_peak_kb, rss_kb = _status_kb("VmHWM"), _status_kb("VmRSS")
    reset = _reset_peak_rss()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_before = torch.cuda.memory_allocated()
    t0 = time.time()
    lb_peak_kb, step_peak_kb = 0, 0
    for _ in range(args.steps):
        if reset:  # the loss + backward's own high-water mark, then the whole step's
            step_peak_kb = max(step_peak_kb, _status_kb("VmHWM"))
            _reset_peak_rss()
        loss = grpo.calculate_loss(rollouts, rewards)
        loss.backward()
        lb_peak_kb = max(lb_peak_kb, _status_kb("VmHWM"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    step_peak_kb = max(step_peak_kb, _status_kb("VmHWM"))
    if cuda:
        torch.cuda.synchronize()
    step_s = (time.time() - t0) / args.steps
    out = dict(
        variant=args.worker,
        params_total=sum(p.numel() for p in model.parameters()),
        params_trainable=sum(p.numel() for p in params),
        load_s=round(load_s, 2), step_s=round(step_s, 2),
        rss_baseline_mb=round(baseline_kb / 1024, 1),
        rss_after_load_mb=round(rss_kb / 1024, 1), load_peak_rss_mb=round(load_peak_kb / 1024, 1),
        step_peak_rss_mb=round(step_peak_kb / 1024, 1) if reset else None,
        loss_backward_peak_rss_mb=round(lb_peak_kb / 1024, 1) if reset else None,
        tokens_per_step=args.batch * (args.prompt_len + args.response_len),
    )
    if reset:
        out["step_peak_over_baseline_mb"] = round(out["step_peak_rss_mb"] - out["rss_baseline_mb"], 1)
    if cuda:
        out["cuda_before_step_mb"] = round(cuda_before / 2**20, 1)
        out["cuda_step_peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def save_checkpoint(path: str, args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from SimpleTorchLLMRL.testing.tiny import tiny_tokenizer

    tok = tiny_tokenizer("chatml")  # text for the prompts; the model may have a larger vocabulary
    vocab = max(args.vocab or 0, len(tok))
    config = Qwen2Config(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=max(1, args.heads // 8), max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    AutoTokenizer.from_pretrained(path)  # fail early if it does not load back


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 * rank)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--group", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=192)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("memory.py: CUDA is not available, nothing measured (run it on a machine with a GPU, "
                  "or use --device cpu).")
            return
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"--variants must be a comma list of {VARIANTS}, got {bad}")
    results = []
    with tempfile.TemporaryDirectory() as ckpt:
        save_checkpoint(ckpt, args)
        shared = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                  if k not in ("variants", "json", "worker", "ckpt") and v is not None]
        for v in variants:
            cmd = [sys.executable, os.path.abspath(__file__), *shared, "--worker", v, "--ckpt", ckpt]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, WANDB_MODE="disabled"))
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"variant {v} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
            results.append(json.loads(lines[-1][len("RESULT "):]))
            print(json.dumps(results[-1]), flush=True)
    cols = ["variant", "params_total", "params_trainable", "rss_baseline_mb", "rss_after_load_mb",
            "load_peak_rss_mb", "step_peak_rss_mb", "step_peak_over_baseline_mb", "step_s"] + (["cuda_before_step_mb", "cuda_step_peak_mb"] if args.device == "cuda" else [])
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r.get(c)) for c in cols) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=2)


if __name__ == "__main__":
    main()
