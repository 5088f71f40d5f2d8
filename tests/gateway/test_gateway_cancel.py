"""Cancellation: a row its watch cancels stops within a few decode steps and the other rows sample exactly
what they would have; over HTTP, a client that hangs up (streaming or not) stops its rows, nothing is
recorded for it, and a request batched with it gets the same ids as without the hang-up. Both HF loops
(the fast decode runs eagerly on CPU). Servers on 127.0.0.1."""

import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from SimpleTorchLLMRL import ModelGenerate  # noqa: E402
from SimpleTorchLLMRL.chat.message import Rollout  # noqa: E402
from SimpleTorchLLMRL.gateway import Gateway, batcher  # noqa: E402
from SimpleTorchLLMRL.model.generation.fast_decode import STREAM_EVERY  # noqa: E402
from SimpleTorchLLMRL.model.generation.generator import BackendConfig
from SimpleTorchLLMRL.model.generation.sampling import (
    DecodeWatch,  # noqa: E402
    SamplingConfig,
)
from tests.gateway.test_gateway_streaming import NEVER, StepCounter, content_of, sse_chunks  # noqa: E402
from tests.support.gateway_helpers import start  # noqa: E402

DECODES = ("default", "fast")
LONG = 900  # tokens a long reply would run to (the tiny model's context is 1024)


def every(decode: str) -> int:
    """Decode steps between the points where a loop reads the cancel flags."""
    return 1 if decode == "default" else STREAM_EVERY


# ----------------------------------------------------------------------------- the decode loops


@pytest.mark.parametrize("decode", DECODES)
def test_a_cancelled_row_stops_and_the_others_sample_the_same_ids(calc, decode):
    model, tok = calc
    gen = ModelGenerate(model, tok,
                        sampling=SamplingConfig(max_new_tokens=40, temperature=1.0, eos_token_ids=[NEVER]),
                        backend=BackendConfig(decode=decode))
    rollouts = [Rollout.from_chat(start("What is 2 + 2?")), Rollout.from_chat(start())]
    plain = [m for group in gen.generate(rollouts, 2, seed=9) for m in group]
    seen: dict[int, int] = {}

    def on_tokens(rows, ids):
        for r, new in zip(rows, ids, strict=True):
            seen[r] = seen.get(r, 0) + len(new)

    watch = DecodeWatch(on_tokens, cancelled=lambda row: row == 1 and seen.get(1, 0) >= 5)
    got = [m for group in gen.generate(rollouts, 2, seed=9, watch=watch) for m in group]
    assert [m.token_ids for k, m in enumerate(got) if k != 1] == [m.token_ids for k, m in enumerate(plain) if k != 1]
    assert [m.logprobs for k, m in enumerate(got) if k != 1] == [m.logprobs for k, m in enumerate(plain) if k != 1]
    stopped = watch.given_up_at(1)
    assert 5 <= stopped < 5 + every(decode) and len(got[1].token_ids) == stopped
    assert got[1].token_ids == plain[1].token_ids[:stopped] and got[1].finish_reason == "length"


@pytest.mark.parametrize("decode", DECODES)
def test_a_call_whose_rows_are_all_cancelled_stops_within_a_few_steps(calc, decode):
    model, tok = calc
    gen = ModelGenerate(model, tok,
                        sampling=SamplingConfig(max_new_tokens=LONG, temperature=1.0, eos_token_ids=[NEVER]),
                        backend=BackendConfig(decode=decode))
    steps = StepCounter(model)
    flag = {"at": None}

    def on_tokens(rows, ids):
        if flag["at"] is None and steps.count >= 10:
            flag["at"] = steps.count  # cancelled from here on

    try:
        [[msg]] = gen.generate([Rollout.from_chat(start())], watch=DecodeWatch(on_tokens, lambda r: flag["at"] is not None))
    finally:
        steps.remove()
    assert steps.count - flag["at"] <= every(decode)  # forwards after the cancel: at most one check's worth
    assert len(msg.token_ids) < 10 + every(decode) < LONG


# ----------------------------------------------------------------------------- over HTTP


def long_gateway(calc, decode: str, **kw) -> Gateway:
    model, tok = calc
    return Gateway(ModelGenerate(model, tok, seed=0,
                                 sampling=SamplingConfig(max_new_tokens=LONG, temperature=1.0,
                                                         eos_token_ids=[NEVER]),
                                 backend=BackendConfig(decode=decode)), **kw)


BODY = {"model": "policy", "messages": [{"role": "user", "content": "Count."}], "max_tokens": LONG, "seed": 4}


class CancelSpy:
    """Records the model's forward count when a call's job is cancelled (the server saw the hang-up)."""

    def __init__(self, monkeypatch, steps: StepCounter):
        self.at: list[int] = []
        original = batcher.Job.cancel

        def cancel(job):
            self.at.append(steps.count)
            original(job)

        monkeypatch.setattr(batcher.Job, "cancel", cancel)


def wait_idle(steps: StepCounter, quiet: float = 0.5, limit: float = 60) -> None:
    """Until the model has not run for `quiet` seconds."""
    deadline, last, since = time.monotonic() + limit, -1, time.monotonic()
    while time.monotonic() < deadline:
        if steps.count != last:
            last, since = steps.count, time.monotonic()
        elif time.monotonic() - since > quiet:
            return
        time.sleep(0.05)
    raise AssertionError("the model kept running")


@pytest.mark.parametrize("decode", DECODES)
def test_a_stream_whose_client_hangs_up_stops_and_records_nothing(calc, decode, monkeypatch):
    model, _ = calc
    gw = long_gateway(calc, decode)
    steps = StepCounter(model)
    spy = CancelSpy(monkeypatch, steps)
    try:
        with gw.serve() as url:
            with httpx.stream("POST", f"{url}/chat/completions", json={**BODY, "stream": True},
                              headers={"Authorization": "Bearer leaver"}, timeout=120) as r:
                for line in r.iter_lines():
                    if content_of(sse_chunks([line])):
                        break  # the first content chunk: hang up
            wait_idle(steps)
            assert len(spy.at) == 1, "the server never cancelled the call"
            assert steps.count - spy.at[0] <= every(decode) + 1  # a few decode steps after the hang-up
            assert steps.count < LONG // 2
            assert "leaver" not in gw.sessions()
            ok = httpx.post(f"{url}/chat/completions", json={**BODY, "max_tokens": 5},
                            headers={"Authorization": "Bearer next"}, timeout=120)
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
    finally:
        steps.remove()


def test_a_non_streaming_client_that_hangs_up_stops_its_rows(calc, monkeypatch):
    model, _ = calc
    gw = long_gateway(calc, "default")
    steps = StepCounter(model, hold_at=20)  # the 20th step waits until the client has left
    spy = CancelSpy(monkeypatch, steps)
    try:
        with gw.serve() as url:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/chat/completions", json=BODY, headers={"Authorization": "Bearer impatient"},
                           timeout=httpx.Timeout(30, read=0.5))
            assert steps.held.wait(30)
            deadline = time.monotonic() + 30
            while not spy.at and time.monotonic() < deadline:  # the server notices the dropped connection
                time.sleep(0.02)
            steps.release.set()
            wait_idle(steps)
            assert spy.at and steps.count - spy.at[0] <= 2  # the held step and at most one more
            assert "impatient" not in gw.sessions()
    finally:
        steps.remove()


@pytest.mark.parametrize("decode", DECODES)
def test_a_request_batched_with_a_hung_up_stream_gets_the_same_ids(calc, decode):
    """Two requests in one generate call (one batch: same options and seed); the stream hangs up after its first
    content chunk. The other request's ids, log-probs and recorded rollout are those of the same batch without
    the hang-up."""

    def run(hang_up: bool) -> tuple[dict, list[int]]:
        gw = long_gateway(calc, decode, window=1.0)
        body = {**BODY, "max_tokens": 200}
        with gw.serve() as url:
            out: dict = {}

            def stay():
                out["reply"] = httpx.post(f"{url}/chat/completions", json={**body, "logprobs": True},
                                          headers={"Authorization": "Bearer stayer"}, timeout=120).json()

            thread = threading.Thread(target=stay)
            with httpx.stream("POST", f"{url}/chat/completions", json={**body, "stream": True},
                              headers={"Authorization": "Bearer leaver"}, timeout=120) as r:
                thread.start()
                for line in r.iter_lines():
                    if hang_up and content_of(sse_chunks([line])):
                        break
            thread.join(120)
        assert list(gw.batcher.batches) == [2]
        assert ("leaver" in gw.sessions()) is not hang_up
        [rollout] = gw.rollouts("stayer")
        return out["reply"], rollout[-1].token_ids

    with_hang_up, ids = run(True)
    without, ids_without = run(False)
    assert ids == ids_without and len(ids) == 200
    assert with_hang_up["choices"][0]["logprobs"] == without["choices"][0]["logprobs"]
    assert with_hang_up["choices"][0]["message"] == without["choices"][0]["message"]
