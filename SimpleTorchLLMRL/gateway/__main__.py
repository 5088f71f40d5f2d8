"""Serve a local model behind the OpenAI Chat Completions API and record every session.

    uv run python -m SimpleTorchLLMRL.gateway --model DIR --port 8000 --record-to rollouts.jsonl

Clients: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY)`. Rollouts are written
to --record-to as they become final, a session's when it is idle past --session-ttl or is the
least recently used past --max-sessions, and every session's when the server stops (Ctrl-C).
With --admin-key, a trainer in another process lists the open sessions (GET /v1/sessions) and
takes a finished episode's rollouts (POST /v1/sessions/{id}/finish), sending that key as
`Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import signal
import threading


def _checked(kind: type, name: str, ok, rule: str):
    """An argparse type: `kind(text)`, refused unless `ok(value)` (`name`: what argparse calls it)."""
    def check(text: str):
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
        return value

    check.__name__ = name
    return check


_non_negative = _checked(float, "_non_negative", lambda v: v >= 0, "a number >= 0")
_non_negative_int = _checked(int, "_non_negative_int", lambda v: v >= 0, "an integer >= 0")
_positive = _checked(float, "_positive", lambda v: v > 0, "a number > 0")
_positive_int = _checked(int, "_positive_int", lambda v: v >= 1, "an integer >= 1")


def parse_args(argv=None) -> argparse.Namespace:
    from SimpleTorchLLMRL.gateway.request import DEFAULT_MAX_BODY_BYTES

    ap = argparse.ArgumentParser(prog="python -m SimpleTorchLLMRL.gateway", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a local HF model directory (or a vLLM model with --backend vllm); "
                    "the embedded tiny model: SimpleTorchLLMRL/assets/tiny_calc")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--record-to", default=None, help="a .jsonl file that receives the recorded rollouts")
    ap.add_argument("--served-model-name", default="policy", help="the `model` clients ask for")
    ap.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="default max_tokens of a request")
    ap.add_argument("--temperature", type=float, default=1.0, help="default temperature of a request")
    ap.add_argument("--tool-call-stop", nargs="*", default=["</tool_call>"],
                    help="stop strings that end a turn at a finished tool call")
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                    help="larger request bodies are refused with 413 before they are read")
    ap.add_argument("--window", type=_non_negative, default=0.02,
                    help="seconds the first request of a batch waits for others to join it")
    ap.add_argument("--max-batch", type=_positive_int, default=64, help="at most this many requests per batch")
    ap.add_argument("--session-ttl", type=_non_negative, default=600.0,
                    help="a session idle this many seconds is finished: its rollouts are written to --record-to "
                         "and it is forgotten (0: never)")
    ap.add_argument("--max-sessions", type=_non_negative_int, default=10000,
                    help="past this many open sessions the least recently used one is finished the same way "
                         "(0: no limit)")
    ap.add_argument("--compile-budget", type=_positive, default=10.0,
                    help="seconds a request's grammar (response_format, a forced tool call) may take to compile; "
                         "past it the request is a 400 naming the field")
    ap.add_argument("--admin-key", default=None,
                    help="serve the session routes (GET /v1/sessions, POST /v1/sessions/{id}/finish) to requests "
                         "sending `Authorization: Bearer KEY`; without it they are not served")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)

    from SimpleTorchLLMRL.gateway import Gateway
    from SimpleTorchLLMRL.model.generation.generator import ModelGenerate

    if a.backend == "vllm":
        generator = ModelGenerate(a.model, None, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                                  tool_call_stop=a.tool_call_stop or None, backend="vllm")
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.model, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(a.model).eval()
        generator = ModelGenerate(model, tokenizer, max_new_tokens=a.max_new_tokens,
                                  temperature=a.temperature, tool_call_stop=a.tool_call_stop or None)
    gateway = Gateway(generator, model_name=a.served_model_name, record_to=a.record_to,
                      max_body_bytes=a.max_body_bytes, window=a.window, max_batch=a.max_batch,
                      session_ttl=a.session_ttl or None, max_sessions=a.max_sessions or None,
                      compile_budget=a.compile_budget, admin_key=a.admin_key)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with gateway.serve(a.host, a.port) as url:
        print(f"serving {a.served_model_name!r} at {url}", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    gateway.close()


if __name__ == "__main__":
    main()
