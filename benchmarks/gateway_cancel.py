"""A hung-up stream must not hold up the next client: a 5-token request after a 1,000-token stream whose
client left, against the same request on an idle gateway. The embedded model, over 127.0.0.1.

    uv run python benchmarks/gateway_cancel.py [--long 1000] [--short 5] [--after 0.5] [--repeats 3]

Prints the short request's idle latency, its latency right after the hang-up (median of --repeats), their
ratio (goal: at most 2x), and how many tokens the abandoned stream had generated when it stopped.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx
from transformers import AutoModelForCausalLM, AutoTokenizer

from SimpleTorchLLMRL import ModelGenerate
from SimpleTorchLLMRL.gateway import Gateway
from SimpleTorchLLMRL.testing.tiny import TINY_CALC

NEVER = 10**6  # an EOS id no step samples: the long reply runs until it is cancelled or reaches --long
MESSAGES = [{"role": "user", "content": "Count."}]


def short_call(url: str, tokens: int) -> float:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/chat/completions", json={"model": "policy", "messages": MESSAGES, "max_tokens": tokens},
                   headers={"Authorization": "Bearer short"}, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0


def hang_up(url: str, tokens: int, after: float) -> None:
    """Open a stream of `tokens` tokens, read it for `after` seconds, then close the connection."""
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/chat/completions", json={"model": "policy", "messages": MESSAGES,
                                                               "max_tokens": tokens, "stream": True},
                      headers={"Authorization": "Bearer leaver"}, timeout=600) as r:
        for _ in r.iter_lines():
            if time.perf_counter() - t0 >= after:
                break


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", type=int, default=1000)
    ap.add_argument("--short", type=int, default=5)
    ap.add_argument("--after", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode", default="default", choices=["default", "fast"])
    a = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(TINY_CALC).eval()
    tok = AutoTokenizer.from_pretrained(TINY_CALC, padding_side="left")
    gen = ModelGenerate(model, tok, max_new_tokens=a.long, temperature=1.0, seed=0, decode=a.decode,
                        eos_token_ids=[NEVER])
    steps = {"n": 0}
    model.register_forward_pre_hook(lambda *_: steps.__setitem__("n", steps["n"] + 1))
    gw = Gateway(gen)
    with gw.serve() as url:
        short_call(url, a.short)  # warm-up
        idle = statistics.median(short_call(url, a.short) for _ in range(a.repeats))
        after, generated = [], []
        for _ in range(a.repeats):
            before = steps["n"]
            hang_up(url, a.long, a.after)
            after.append(short_call(url, a.short))
            time.sleep(0.2)
            generated.append(steps["n"] - before - (a.short + 1))  # forwards of the long call (less the short one)
        busy = statistics.median(after)
    print(f"decode={a.decode}: a {a.short}-token request idle {idle:.3f} s; after a {a.long}-token stream hung up "
          f"at {a.after} s: {busy:.3f} s ({busy / idle:.2f}x, goal <= 2x); the abandoned stream ran "
          f"{statistics.median(generated):.0f} of {a.long} steps")


if __name__ == "__main__":
    main()
