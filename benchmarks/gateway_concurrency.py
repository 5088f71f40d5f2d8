"""8 agents through the gateway: one after another, then all at once (batched by the gateway).

    uv run python benchmarks/gateway_concurrency.py [--sessions 8] [--max-tokens 40] [--repeats 3]

The embedded tiny model on the HF backend, a real `openai` client per session, sampling at
temperature 1. Prints the seconds of each mode (best of --repeats) and the batch sizes the
gateway generated.
"""

from __future__ import annotations

import argparse
import threading
import time

from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from SimpleTorchLLMRL import ModelGenerate
from SimpleTorchLLMRL.gateway import Gateway
from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT
from SimpleTorchLLMRL.testing.tiny import TINY_CALC


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(TINY_CALC).eval()
    tok = AutoTokenizer.from_pretrained(TINY_CALC, padding_side="left")
    gw = Gateway(ModelGenerate(model, tok, max_new_tokens=a.max_tokens, temperature=1.0, seed=0), window=0.05)

    def call(url: str, name: str, i: int) -> None:
        OpenAI(base_url=url, api_key=name).chat.completions.create(
            model="policy", max_tokens=a.max_tokens, messages=[{"role": "system", "content": SYSTEM_PROMPT},
                                                               {"role": "user", "content": f"What is {100 + i} * 7?"}])

    with gw.serve() as url:
        call(url, "warm-up", 0)
        seq, conc = [], []
        for rep in range(a.repeats):
            t0 = time.perf_counter()
            for i in range(a.sessions):
                call(url, f"seq-{rep}-{i}", i)
            seq.append(time.perf_counter() - t0)
            threads = [threading.Thread(target=call, args=(url, f"conc-{rep}-{i}", i)) for i in range(a.sessions)]
            gw.batcher.batches.clear()
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            conc.append(time.perf_counter() - t0)
    print(f"{a.sessions} sessions, {a.max_tokens} new tokens at most: one after another {min(seq):.2f} s, "
          f"all at once {min(conc):.2f} s ({min(seq) / min(conc):.1f}x), batches of the last run {gw.batcher.batches}")


if __name__ == "__main__":
    main()
