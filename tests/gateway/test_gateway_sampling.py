"""Per-call sampling is an argument, never shared state; finish_reason "tool_calls" only with tool_calls.

A generate call with its own settings (a gateway request's temperature, max_tokens, stop) is held in
flight inside the model's forward while another thread reads the defaults or generates with them.
The gateway is driven over HTTP on 127.0.0.1, as in tests/gateway/test_gateway.py.
"""

import dataclasses
import json
import threading
import time

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")


from SimpleTorchLLMRL import ModelGenerate  # noqa: E402
from SimpleTorchLLMRL.chat.message import MessageType, Rollout  # noqa: E402
from SimpleTorchLLMRL.gateway import Gateway  # noqa: E402
from SimpleTorchLLMRL.model.generation.generator import BackendConfig  # noqa: E402
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig  # noqa: E402
from SimpleTorchLLMRL.tools.parsers import JsonToolCallParser  # noqa: E402
from tests.support.gateway_helpers import start  # noqa: E402

DEFAULTS = dict(max_new_tokens=8, temperature=0.7)  # the generator's own settings
UNUSUAL = SamplingConfig(max_new_tokens=3, temperature=1.9, stop=("zz",))  # one call's settings


class Gate:
    """Holds the model's next forward, once armed, until released: a generate call kept in flight."""

    def __init__(self, model):
        self.armed = False
        self.entered, self.release = threading.Event(), threading.Event()
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if self.armed:
            self.armed = False
            self.entered.set()
            if not self.release.wait(120):
                raise RuntimeError("the gate was never released")

    def remove(self) -> None:
        self.release.set()
        self._handle.remove()


@pytest.fixture
def gate(calc):
    g = Gate(calc[0])
    yield g
    g.remove()


def rollout() -> Rollout:
    return Rollout.from_chat(start())


def in_thread(fn, *args, **kwargs):
    """Run `fn` in a thread; returns (thread, box) where box holds its result or exception."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001  (re-raised by the test)
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def result(thread, box):
    thread.join(timeout=120)
    assert not thread.is_alive(), "the thread did not finish"
    if "error" in box:
        raise box["error"]
    return box["result"]


def assert_defaults(cfg: SamplingConfig) -> None:
    assert (cfg.temperature, cfg.max_new_tokens, cfg.stop) == (0.7, 8, ())


# ----------------------------------------------------------------------------- per-call sampling


def test_a_per_call_generate_in_flight_leaves_the_defaults_to_other_threads(calc, gate):
    """The race of issue 35: while one thread's generate(sampling=...) runs, another thread that reads
    the generator's settings or generates with them gets the defaults, not that call's settings."""
    model, tok = calc
    gen = ModelGenerate(model, tok, seed=0, **DEFAULTS, backend=BackendConfig(decode="default"))
    gate.armed = True
    thread, box = in_thread(gen.generate, [rollout()], sampling=UNUSUAL)
    assert gate.entered.wait(60), "the per-call generate never reached the model"
    try:
        assert_defaults(gen.config)  # what the gateway parsed requests against
        [[msg]] = gen.generate([rollout()])  # a default generate while the other call is in flight
    finally:
        gate.release.set()
    [[theirs]] = result(thread, box)
    assert msg.temperature == 0.7 and len(msg.token_ids) <= 8
    assert theirs.temperature == 1.9 and len(theirs.token_ids) <= 3
    assert_defaults(gen.config)


@pytest.mark.parametrize("decode", ["default", "fast"])
def test_per_call_settings_reach_both_hf_decode_loops_and_only_that_call(calc, decode):
    model, tok = calc
    gen = ModelGenerate(model, tok, seed=0, **DEFAULTS, backend=BackendConfig(decode=decode))
    eos = gen.config.eos_token_ids
    [[one]] = gen.generate([rollout()], sampling=SamplingConfig(max_new_tokens=3, temperature=1.9))
    assert one.temperature == 1.9 and len(one.token_ids) <= 3 and one.finish_reason in ("length", "stop")
    [[greedy]] = gen.generate([rollout()], sampling=SamplingConfig(max_new_tokens=5, do_sample=False,
                                                                   temperature=0.0))
    [[again]] = gen.generate([rollout()], sampling=SamplingConfig(max_new_tokens=5, do_sample=False,
                                                                  temperature=0.0), seed=7)
    assert greedy.token_ids == again.token_ids and greedy.temperature == 1.0
    [[plain]] = gen.generate([rollout()])
    assert plain.temperature == 0.7 and len(plain.token_ids) <= 8
    assert_defaults(gen.config)
    assert gen.config.eos_token_ids == eos
    assert gen.backend.cfg is gen.config  # the backend's default is never swapped


def test_the_backend_takes_the_calls_settings_as_an_argument(calc):
    model, tok = calc
    gen = ModelGenerate(model, tok, seed=0, **DEFAULTS, backend=BackendConfig(decode="default"))
    prompt = gen.prompt_ids([rollout()])
    call = dataclasses.replace(UNUSUAL, eos_token_ids=gen.config.eos_token_ids)
    [[sample]] = gen.backend.generate(prompt, 1, [0], sampling=call)
    assert len(sample.token_ids) <= 3 and gen.backend.logprob_temperature_for(call) == 1.9
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig"):
        gen.backend.generate(prompt, 1, [0], sampling={"temperature": 1.9})


def test_a_request_parsed_while_another_generates_gets_the_gateways_defaults(calc, gate):
    """Over HTTP: request A (temperature 1.9, 3 tokens, a stop string) is held inside the model while
    request B, which sets nothing, arrives and is parsed; B must be sampled with the defaults."""
    model, tok = calc
    gw = Gateway(ModelGenerate(model, tok, seed=0, **DEFAULTS,
                               backend=BackendConfig(decode="default")), window=0.01)
    with gw.serve() as url:
        def post(key: str, **body):
            r = httpx.post(f"{url}/chat/completions", json={"model": "policy", "messages": start(), **body},
                           headers={"Authorization": f"Bearer {key}"}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        gate.armed = True
        a = in_thread(post, "unusual", temperature=1.9, max_tokens=3, stop="zz")
        assert gate.entered.wait(60), "request A never reached the model"
        try:
            b = in_thread(post, "plain")
            deadline = time.monotonic() + 30
            while gw.batcher._queue.qsize() < 1:  # B parsed and waiting behind A's generation
                assert time.monotonic() < deadline, "request B never reached the batcher"
                time.sleep(0.01)
        finally:
            gate.release.set()
        reply_a, reply_b = result(*a), result(*b)
    [mine] = [m for m in gw.rollouts("plain")[0] if m.type is MessageType.MODEL]
    [theirs] = [m for m in gw.rollouts("unusual")[0] if m.type is MessageType.MODEL]
    assert mine.temperature == 0.7 and len(mine.token_ids) <= 8
    assert reply_b["usage"]["completion_tokens"] == len(mine.token_ids)
    assert theirs.temperature == 1.9 and reply_a["usage"]["completion_tokens"] <= 3
    assert_defaults(gw.generator.config)


def test_a_request_with_min_p_is_sampled_and_recorded_with_it(calc):
    """min_p (vLLM's extension field, sent through the OpenAI SDK's extra_body) reaches the draw, is recorded
    on the MODEL message as `sampling`, and the trainer scores the turn as sampled: its log-probs under the
    recorded min-p cut equal the recorded ones (1e-5), and differ from the full softmax's."""
    from SimpleTorchLLMRL.chat.tokenize import rollouts_to_batch
    from SimpleTorchLLMRL.model.scoring.logprobs import token_logprobs

    model, tok = calc
    gw = Gateway(ModelGenerate(model, tok, seed=0, **DEFAULTS,
                               backend=BackendConfig(decode="default")), window=0.01)
    with gw.serve() as url:
        client = openai.OpenAI(base_url=url, api_key="minp", max_retries=0, timeout=120)
        client.chat.completions.create(model="policy", messages=start(), temperature=1.0, max_tokens=12,
                                       extra_body={"min_p": 0.1})
        plain = openai.OpenAI(base_url=url, api_key="plain", max_retries=0, timeout=120)
        plain.chat.completions.create(model="policy", messages=start(), temperature=1.0, max_tokens=4)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="policy", messages=start(), extra_body={"min_p": 1.5})
        assert err.value.body["param"] == "min_p"
        r = httpx.post(f"{url}/completions", json={"model": "policy", "prompt": "1 + 1 =", "min_p": 0.1,
                                                   "max_tokens": 2}, headers={"Authorization": "Bearer legacy"},
                       timeout=120)
        assert r.status_code == 200, r.text  # the legacy path takes it too
    [recorded] = gw.rollouts("minp")
    [m] = [m for m in recorded if m.type is MessageType.MODEL]
    assert m.sampling == {"min_p": 0.1} and m.temperature == 1.0 and len(m.token_ids) >= 4
    [[p]] = [[m for m in x if m.type is MessageType.MODEL] for x in gw.rollouts("plain")]
    assert p.sampling is None
    assert_defaults(gw.generator.config)  # the request's min_p was its own
    batch = rollouts_to_batch([recorded], tok)
    known = ~torch.isnan(batch.sampler_logprobs) & batch.loss_mask.bool()
    assert int(known.sum()) == len(m.token_ids)
    with torch.no_grad():
        cut = token_logprobs(model, batch, 1.0, positions=batch.loss_mask, truncation=batch.truncation)
        full = token_logprobs(model, batch, 1.0, positions=batch.loss_mask)
    gap = lambda lp: float((lp - batch.sampler_logprobs)[known].abs().max())  # noqa: E731
    assert gap(cut) <= 1e-5
    assert gap(full) > 1e-3  # the test can fail: the full softmax is not what was sampled from


# ----------------------------------------------------------------------------- finish_reason


class RejectingParser:
    """Finds the Hermes calls and refuses them (a stricter parser, e.g. one checking a schema)."""

    def parse(self, text: str):
        return [dataclasses.replace(c, error="the arguments do not match the tool's schema")
                for c in JsonToolCallParser().parse(text)]


def make_gateway(calc, env, **kw) -> Gateway:
    model, tok = calc
    gen = ModelGenerate(model, tok, max_new_tokens=40, temperature=1.0, tool_call_stop=env.stop_strings,
                        seed=0)
    return Gateway(gen, **kw)


def streamed(url: str, key: str, **body) -> list[dict]:
    """The chat.completion.chunk objects of a streamed request."""
    r = httpx.post(f"{url}/chat/completions", json={"model": "policy", "messages": start(), "stream": True,
                                                    "temperature": 0, **body},
                   headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200, r.text
    lines = [ln[len("data: "):] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def stream_view(chunks: list[dict]) -> tuple[str, list, list]:
    """(content, tool-call deltas, finish reasons) of a one-choice stream."""
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join(c["delta"].get("content") or "" for c in choices)
    calls = [tc for c in choices for tc in c["delta"].get("tool_calls") or []]
    return text, calls, [c["finish_reason"] for c in choices if c["finish_reason"]]


def stopped_at_the_tool_call_stop(gw: Gateway, key: str) -> None:
    """The scenario holds: the model ended its turn at the tool-call stop string."""
    [m] = [m for m in gw.rollouts(key)[0] if m.type is MessageType.MODEL]
    assert m.finish_reason == "tool_call" and m.content.rstrip().endswith("</tool_call>")


def test_a_tool_call_without_tools_in_the_request_finishes_with_stop(calc, env):
    gw = make_gateway(calc, env)
    with gw.serve() as url:
        client = openai.OpenAI(base_url=url, api_key="no-tools")
        r = client.chat.completions.create(model="policy", messages=start(), temperature=0)
        stopped_at_the_tool_call_stop(gw, "no-tools")
        choice = r.choices[0]
        assert "<tool_call>" in choice.message.content and not choice.message.tool_calls
        assert choice.finish_reason == "stop"
        text, calls, finish = stream_view(streamed(url, "no-tools-stream"))
        stopped_at_the_tool_call_stop(gw, "no-tools-stream")
        assert "<tool_call>" in text and calls == [] and finish == ["stop"]
        # with the tools offered, the same turn is a call: finish_reason "tool_calls" and the calls
        r = client.chat.completions.create(model="policy", messages=start(), tools=env.tools, temperature=0)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls
        text, calls, finish = stream_view(streamed(url, "tools-stream", tools=env.tools))
        assert calls and finish == ["tool_calls"]


def test_a_tool_call_that_does_not_parse_finishes_with_stop(calc, env):
    gw = make_gateway(calc, env, tool_parsers=[RejectingParser()])
    with gw.serve() as url:
        client = openai.OpenAI(base_url=url, api_key="malformed")
        r = client.chat.completions.create(model="policy", messages=start(), tools=env.tools, temperature=0)
        stopped_at_the_tool_call_stop(gw, "malformed")
        choice = r.choices[0]
        assert "<tool_call>" in choice.message.content and not choice.message.tool_calls
        assert choice.finish_reason == "stop"
        text, calls, finish = stream_view(streamed(url, "malformed-stream", tools=env.tools))
        assert "<tool_call>" in text and calls == [] and finish == ["stop"]


def test_finish_reason_maps_the_generators_reasons(env):
    from SimpleTorchLLMRL.chat.message import Message, MessageType
    from SimpleTorchLLMRL.gateway.chat import reply_choice
    from tests.support.gateway_helpers import parse_chat

    def finish(reason, text="x", tools=None):
        req = parse_chat({"messages": start(), **({"tools": tools} if tools else {})})
        return reply_choice(0, Message(text, MessageType.MODEL, finish_reason=reason), req, None).finish_reason

    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call>'
    assert finish("tool_call", call, env.tools) == "tool_calls"
    assert finish("tool_call", call) == "stop"  # no tools offered: no call shown
    assert (finish("stop"), finish("length"), finish(None)) == ("stop", "length", "stop")
    assert finish("length", call + "\n<tool_", env.tools) == "length"  # cut while writing a second call

