"""The per-call settings race of issue 35, replayed: what a request that sets nothing gets while another call's
own settings are in flight.

    uv run python benchmarks/gateway_race.py

Two threads on one `ModelGenerate` (the embedded model, defaults temperature 0.7, 8 tokens, no stop string):
the first generates with its own settings (temperature 1.9, 3 tokens, stop "zz") and is held inside the
model's forward; meanwhile the second reads the generator's settings (what the gateway parses requests
against) and generates with the defaults. Prints what each saw; the second must see the defaults.
(tests/gateway/test_gateway_sampling.py holds the same scenario as a test.)
"""

from __future__ import annotations

import threading

from transformers import AutoModelForCausalLM, AutoTokenizer

from SimpleTorchLLMRL import ModelGenerate
from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.model.generation.generator import BackendConfig
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
from SimpleTorchLLMRL.testing.tiny import TINY_CALC

UNUSUAL = SamplingConfig(max_new_tokens=3, temperature=1.9, stop=("zz",))


def main() -> None:
    model = AutoModelForCausalLM.from_pretrained(TINY_CALC).eval()
    tok = AutoTokenizer.from_pretrained(TINY_CALC, padding_side="left")
    gen = ModelGenerate(model, tok, max_new_tokens=8, temperature=0.7, seed=0,
                        backend=BackendConfig(decode="default"))
    prompt = Rollout.from_chat([{"role": "user", "content": "What is 2 + 2?"}])
    entered, release, armed = threading.Event(), threading.Event(), [True]

    def hold(module, args):  # the per-call generate's first forward waits here
        if armed[0] and threading.current_thread().name == "per-call":
            armed[0] = False
            entered.set()
            release.wait(120)

    handle = model.register_forward_pre_hook(hold)
    box: dict = {}
    first = threading.Thread(target=lambda: box.update(msg=gen.generate([prompt], sampling=UNUSUAL)[0][0]),
                             name="per-call")
    first.start()
    if not entered.wait(120):
        raise RuntimeError("the per-call generate never reached the model")
    try:
        cfg = gen.config
        seen = f"temperature {cfg.temperature}, max_new_tokens {cfg.max_new_tokens}, stop {list(cfg.stop)}"
        other = gen.generate([prompt])[0][0]
    finally:
        release.set()
        first.join(120)
        handle.remove()
    mine = box["msg"]
    print(f"per-call thread (temperature 1.9, 3 tokens, stop 'zz'): recorded temperature {mine.temperature}, "
          f"{len(mine.token_ids)} tokens")
    print(f"default thread while it was in flight: read {seen}; generated at temperature {other.temperature}, "
          f"{len(other.token_ids)} tokens")
    ok = (cfg.temperature, cfg.max_new_tokens, cfg.stop, other.temperature) == (0.7, 8, (), 0.7) \
        and len(other.token_ids) <= 8 and mine.temperature == 1.9 and len(mine.token_ids) <= 3
    print("no leak: the default request got the defaults" if ok else "LEAK: the default request got another call's settings")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
