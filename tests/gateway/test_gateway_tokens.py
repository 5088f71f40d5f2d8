"""POST /inference/v1/generate, the token-in/token-out route (verifiers' renderer client, prime-rl): vLLM's wire
format, every field honoured or refused by name, and each call recorded in its session by id prefix, merging
and forking as chat calls do, with ids identical to the chat path's. Raw httpx over 127.0.0.1."""

import threading

import httpx
import pytest

pytest.importorskip("fastapi")

from SimpleTorchLLMRL.chat.message import MessageType, Rollout  # noqa: E402
from SimpleTorchLLMRL.chat.tokenize import encode_prompt, encode_rollout  # noqa: E402
from tests.support.gateway_helpers import start  # noqa: E402
from tests.support.generation_helpers import reference_logprobs  # noqa: E402

SERVED = dict(max_new_tokens=12, tool_call_stop=())  # the `served` gateway (tests/gateway/conftest.py)


def prompt_ids(tok, messages=None) -> list[int]:
    return encode_prompt(Rollout.from_chat(messages or start()), tok)


def generate(url: str, ids: list[int], session: str | None = None, status: int = 200, **params) -> dict:
    body = {"model": "policy", "token_ids": ids, "sampling_params": {"max_tokens": 8, **params}}
    return post(url, body, session, status)


def post(url: str, body: dict, session: str | None = None, status: int = 200) -> dict:
    headers = {"X-Session-Id": session} if session else {}
    r = httpx.post(url.removesuffix("/v1") + "/inference/v1/generate", json=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def sampled(choice: dict) -> list[int]:
    return choice["token_ids"]


def flat(rollout) -> list[int]:
    return [t for m in rollout for t in m.token_ids]


# ----------------------------------------------------------------------------- the wire


def test_the_reply_is_vllms_token_response_with_exact_logprobs(served, calc):
    gw, url = served
    model, tok = calc
    ids = prompt_ids(tok)
    out = generate(url, ids, "wire-1", temperature=1.0, seed=3, logprobs=1, stop_token_ids=[tok.eos_token_id],
                   skip_special_tokens=False)
    assert set(out) == {"request_id", "model", "choices", "usage"} and out["request_id"]
    [choice] = out["choices"]
    got = sampled(choice)
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length") and got
    content = choice["logprobs"]["content"]
    # verifiers' renderers read "token_id:<id>" (renderers.client._parse_completion_logprobs); vLLM 0.32 `token_id`
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in got]
    assert [c["token_id"] for c in content] == got
    reference = reference_logprobs(model, ids, got, 1.0).tolist()
    assert [c["logprob"] for c in content] == pytest.approx(reference, abs=2e-4)  # under the sampling temperature
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(got),
                            "total_tokens": len(ids) + len(got)}
    again = generate(url, ids, "wire-2", temperature=1.0, seed=3, logprobs=0, stop_token_ids=[tok.eos_token_id])
    assert sampled(again["choices"][0]) == got  # the seed holds
    echoed = post(url, {"model": "policy", "token_ids": ids, "request_id": "req-7", "return_token_ids": True,
                        "sampling_params": {"max_tokens": 2}})
    assert echoed["request_id"] == "req-7" and echoed["prompt_token_ids"] == ids


def test_stop_token_ids_end_a_reply_as_eos_does(served, calc):
    _, url = served
    _, tok = calc
    ids = prompt_ids(tok)
    first = sampled(generate(url, ids, seed=11, temperature=1.0)["choices"][0])
    stopped = generate(url, ids, seed=11, temperature=1.0, stop_token_ids=[first[1]])["choices"][0]
    assert sampled(stopped) == first[:2] and stopped["finish_reason"] == "stop"  # the stop id kept, as vLLM does
    long = generate(url, ids, seed=11, temperature=1.0, max_tokens=1)["choices"][0]
    assert sampled(long) == first[:1] and long["finish_reason"] == "length"


def test_n_choices_each_with_their_ids(served, calc):
    _, url = served
    out = generate(url, prompt_ids(calc[1]), n=3, seed=5)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(len(c["logprobs"]["content"]) == len(c["token_ids"]) for c in out["choices"])


@pytest.mark.parametrize("body,param,code", [
    ({"token_ids": [1, 2], "sampling_params": {"best_of": 2}}, "sampling_params.best_of", "unknown_parameter"),
    ({"token_ids": [1, 2], "sampling_params": {"logprobs": 5}}, "sampling_params.logprobs", "unsupported_parameter"),
    ({"token_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.2}}, "sampling_params.repetition_penalty",
     "unsupported_parameter"),
    ({"token_ids": [1, 2], "sampling_params": {"temperature": "1"}}, "sampling_params.temperature", None),
    ({"token_ids": [1, 2], "sampling_params": {"stop_token_ids": [-1]}}, "sampling_params.stop_token_ids", None),
    ({"token_ids": [1, 2], "sampling_params": {"stop_token_ids": 0}}, "sampling_params.stop_token_ids", None),
    ({"token_ids": [1, 2], "sampling_params": []}, "sampling_params", None),
    ({"token_ids": [1, 2], "stream": True}, "stream", "unsupported_parameter"),
    ({"token_ids": [1, 2], "features": {"mm_hashes": {}}}, "features", "unsupported_parameter"),
    ({"token_ids": [1, 2], "prompt": "hi"}, "prompt", "unknown_parameter"),
    ({"token_ids": []}, "token_ids", None),
    ({"token_ids": [1, 10**9]}, "token_ids", None),
    ({"token_ids": [1, True]}, "token_ids", None),
    ({"token_ids": "1 2"}, "token_ids", None),
])
def test_every_refused_field_is_named(served, body, param, code):
    err = post(served[1], {"model": "policy", **body}, status=400)["error"]
    assert err["param"] == param and err["code"] == code, err


def test_a_prompt_past_the_context_and_another_model_are_refused(served):
    gw, url = served
    err = post(url, {"model": "policy", "token_ids": [1] * gw.max_context, "sampling_params": {"max_tokens": 4}},
               status=400)["error"]
    assert err["param"] == "token_ids" and err["code"] == "context_length_exceeded"
    err = post(url, {"model": "other", "token_ids": [1, 2]}, status=404)["error"]
    assert err["code"] == "model_not_found"


def test_models_carry_max_model_len(served):
    gw, url = served
    [card] = httpx.get(url + "/models", timeout=30).json()["data"]
    assert card["id"] == "policy" and card["max_model_len"] == gw.max_context == 1024
    assert httpx.get(url + "/models/policy", timeout=30).json()["max_model_len"] == 1024


# ----------------------------------------------------------------------------- recorded: merge and fork by ids


def test_a_token_session_merges_and_its_ids_are_exactly_what_was_sent_and_sampled(served, calc):
    gw, url = served
    _, tok = calc
    ids = prompt_ids(tok)
    one = generate(url, ids, "tok-merge", seed=1)["choices"][0]
    tail = tok("<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n",
               add_special_tokens=False)["input_ids"]
    second = ids + sampled(one) + tail
    two = generate(url, second, "tok-merge", seed=2)["choices"][0]
    [rollout] = gw.rollouts("tok-merge")
    assert flat(rollout) == second + sampled(two)  # the last prompt and its reply, exactly
    kinds = [(m.type, m.is_trainable) for m in rollout]
    assert kinds == [(MessageType.MESSAGE, False), (MessageType.MODEL, True), (MessageType.MESSAGE, False),
                     (MessageType.MODEL, True)]
    assert rollout[0].content == tok.decode(ids) and rollout[2].content == tok.decode(tail)
    assert rollout[3].logprobs == [c["logprob"] for c in two["logprobs"]["content"]]
    assert rollout.metadata == {"session": "tok-merge", "prompt": "token_ids"}
    with pytest.raises(ValueError, match="only MODEL turns are sampled"):  # ids sent as ids have no messages
        encode_rollout(rollout, tok)


def test_a_token_session_forks_when_its_ids_do_not_continue_a_reply(served, calc):
    gw, url = served
    _, tok = calc
    ids = prompt_ids(tok)
    one = generate(url, ids, "tok-fork", seed=1, n=2)["choices"]
    edited = ids + [sampled(one[0])[0] + 1] + sampled(one[0])[1:]  # the reply changed: a new prompt
    generate(url, edited, "tok-fork", seed=2)
    rollouts = gw.rollouts("tok-fork")
    assert [flat(r)[:len(ids)] == ids for r in rollouts] == [True, True, True]
    assert flat(rollouts[0]) == ids + sampled(one[0]) and flat(rollouts[1]) == ids + sampled(one[1])
    assert flat(rollouts[2])[:len(edited)] == edited and len(rollouts[2]) == 2  # one context stretch, one reply
    # n = 2, the client continues the second choice: it merges; the first is finished on its own
    three = generate(url, ids, "tok-n", seed=3, n=2)["choices"]
    generate(url, ids + sampled(three[1]), "tok-n", seed=4)
    first, merged = gw.rollouts("tok-n")
    assert flat(first) == ids + sampled(three[0])
    assert [m.type for m in merged] == [MessageType.MESSAGE, MessageType.MODEL, MessageType.MODEL]


def test_token_calls_record_the_same_ids_as_the_chat_path(served, calc):
    """One episode sent as chat and as token ids (the chat path's prompts, what a renderer on the same template
    sends), with the same seeds: the same sampled ids, and the token session's ids are exactly `encode_rollout`
    of the chat session's rollout."""
    gw, url = served
    model, tok = calc
    chat = httpx.Client(base_url=url, headers={"X-Session-Id": "as-chat"}, timeout=60)
    messages = start()
    first = chat.post("/chat/completions", json={"model": "policy", "messages": messages, "seed": 21,
                                                 "max_tokens": 8, "return_token_ids": True}).json()
    messages = [*messages, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Are you sure?"}]
    second = chat.post("/chat/completions", json={"model": "policy", "messages": messages, "seed": 22,
                                                  "max_tokens": 8, "return_token_ids": True}).json()
    [as_chat] = gw.rollouts("as-chat")
    a = generate(url, first["prompt_token_ids"], "as-tokens", seed=21)["choices"][0]
    b = generate(url, second["prompt_token_ids"], "as-tokens", seed=22)["choices"][0]
    assert sampled(a) == first["choices"][0]["token_ids"] and sampled(b) == second["choices"][0]["token_ids"]
    [as_tokens] = gw.rollouts("as-tokens")  # merged, as the chat episode did
    enc = encode_rollout(as_chat, tok)
    assert flat(as_tokens) == enc.input_ids == second["prompt_token_ids"] + sampled(b)
    trained = [t for t, k in zip(enc.input_ids, enc.loss_mask, strict=True) if k]
    assert trained == [t for m in as_tokens if m.type is MessageType.MODEL for t in m.token_ids]


def test_concurrent_token_episodes_under_one_key_are_one_session_each(served, calc):
    gw, url = served
    _, tok = calc
    ids = prompt_ids(tok)
    tail = tok("<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    ends, errors = {}, []

    def episode(k: int):
        try:
            headers = {"Authorization": "Bearer shared-key"}
            base = url.removesuffix("/v1") + "/inference/v1/generate"
            body = {"model": "policy", "token_ids": ids, "sampling_params": {"max_tokens": 6, "seed": 100 + k}}
            one = httpx.post(base, json=body, headers=headers, timeout=60).json()["choices"][0]["token_ids"]
            body["token_ids"] = ids + one + tail
            two = httpx.post(base, json=body, headers=headers, timeout=60).json()["choices"][0]["token_ids"]
            ends[k] = body["token_ids"] + two
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=episode, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(ends) == 4
    rollouts = gw.take(["shared-key"])["shared-key"]
    assert sorted(flat(r) for r in rollouts) == sorted(ends.values())  # one merged rollout per episode
    assert "shared-key" not in gw.sessions()
