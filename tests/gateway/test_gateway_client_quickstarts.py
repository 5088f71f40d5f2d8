"""What a new user hit driving the gateway with the clients' own quickstarts (openai SDK, smolagents, raw HTTP).

- A client that hangs up on POST /v1/completions (streamed or not) must stop its rows, as chat calls do:
  before, the abandoned generation ran to max_tokens and every other session waited behind it.
- /v1/completions refuses a field it does not know (OpenAI's `unknown_parameter`), never ignores it.
- A chat request's own `stop` string is left out of the content, as OpenAI does (smolagents'
  `OpenAIServerModel` relies on it); the returned and recorded ids keep it, as sampled, and the client's
  replay of the shorter content still merges into the same rollout.
"""

import json
import socket
import threading
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from SimpleTorchLLMRL import ModelGenerate  # noqa: E402
from SimpleTorchLLMRL.gateway import Gateway  # noqa: E402
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig  # noqa: E402
from tests.support.gateway_helpers import load_calc, start  # noqa: E402

EOS = 2  # <|im_end|> of the embedded model
NO_TOOL_CALL = {"30": -100}  # "<": greedy then answers \boxed{...} instead of opening a tool call


def client(url: str, key: str):
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)


# ----------------------------------------------------------------------------- /v1/completions hang-ups


def post_then_hang_up(url: str, path: str, body: dict, generating: threading.Event) -> None:
    """POST `body` over a raw socket and close it once its generation has begun."""
    at = urlparse(url)
    data = json.dumps(body).encode()
    with socket.create_connection((at.hostname, at.port), timeout=60) as sock:
        sock.sendall(f"POST {at.path}{path} HTTP/1.1\r\nHost: {at.hostname}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        assert generating.wait(60), "the generation never started"


@pytest.mark.parametrize("stream", [False, True])
def test_a_completions_client_that_hangs_up_stops_its_rows(served, monkeypatch, stream):
    gw, url = served
    generating, returned, lengths = threading.Event(), threading.Event(), []
    real = gw.generator.generate

    def watched(*args, **kwargs):
        generating.set()
        out = real(*args, **kwargs)
        lengths.extend(len(m.token_ids) for ms in out for m in ms)
        returned.set()
        return out

    monkeypatch.setattr(gw.generator, "generate", watched)
    long = {"model": "policy", "prompt": "1 + 1 =", "max_tokens": 600, "logit_bias": {str(EOS): -100},
            "stream": stream}  # EOS banned, no stop string: only a cancel ends it before 600 tokens
    post_then_hang_up(url, "/completions", long, generating)
    assert returned.wait(180)
    assert len(lengths) == 1 and lengths[0] < 300, f"the abandoned rows ran on: {lengths} of 600 tokens"
    monkeypatch.undo()
    # the gateway serves on, and the next completion is whole
    reply = client(url, "after").completions.create(model="policy", prompt="1 + 1 =", max_tokens=5,
                                                    logit_bias={str(EOS): -100})
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"


def test_completions_refuse_a_field_they_do_not_know(served):
    _, url = served
    c = client(url, "fields")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="policy", prompt="1 + 1 =", max_tokens=2, extra_body={"top_k": 5})
    assert e.value.body["code"] == "unknown_parameter" and e.value.body["param"] == "top_k"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="policy", prompt="1 + 1 =", max_tokens=2, extra_body={"stream_options": "usage"})
    assert e.value.body["param"] == "stream_options"
    ok = c.completions.create(model="policy", prompt="1 + 1 =", max_tokens=2, user="someone")  # no effect: accepted
    assert ok.usage.completion_tokens <= 2


# ----------------------------------------------------------------------------- chat `stop`


def test_a_chat_stop_string_is_left_out_of_the_content_but_not_the_ids(served):
    gw, url = served
    tok = gw.generator.tokenizer
    c = client(url, "stop-1")
    ask = dict(model="policy", temperature=0, stop=["}"], logit_bias=NO_TOOL_CALL)
    reply = c.chat.completions.create(messages=start(), extra_body={"return_token_ids": True}, **ask)
    choice, ids = reply.choices[0], reply.choices[0].model_extra["token_ids"]
    sampled = tok.decode(ids, skip_special_tokens=True)
    assert choice.finish_reason == "stop" and sampled.endswith("}"), sampled  # the scenario: "}" ended the turn
    assert choice.message.content == sampled[:-1] and "}" not in choice.message.content
    streamed = client(url, "stop-1-stream").chat.completions.create(messages=start(), stream=True, **ask)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == choice.message.content
    # the recorded MODEL message keeps what was sampled; the client's replay of the shorter text merges
    turn = [*start(), {"role": "assistant", "content": choice.message.content}, {"role": "user", "content": "Sure?"}]
    again = c.chat.completions.create(model="policy", messages=turn, max_tokens=5,
                                      extra_body={"return_token_ids": True})
    [rollout] = gw.rollouts("stop-1")
    model_turns = [m for m in rollout if m.token_ids is not None]
    assert [m.token_ids for m in model_turns] == [ids, again.choices[0].model_extra["token_ids"]]
    assert model_turns[0].content == sampled and model_turns[0].is_trainable


def test_a_chat_stop_that_is_not_a_list_of_strings_is_a_400_naming_it(served):
    _, url = served
    for stop in ([1], [""], ["a", "b", "c", "d", "e"]):
        with pytest.raises(openai.BadRequestError) as e:
            client(url, "stop-bad").chat.completions.create(model="policy", messages=start(), stop=stop)
        assert e.value.body["param"] == "stop", stop


def test_a_left_out_max_tokens_shrinks_to_the_context_the_prompt_leaves():
    """A client that never set max_tokens (the CLI's default is 512) sends a long prompt: the reply gets what
    is left of the context, as at OpenAI and vLLM, not a 400 naming a max_tokens it did not send; a client
    that set max_tokens past what fits still gets the 400 naming it."""
    from SimpleTorchLLMRL.chat.message import Rollout
    from SimpleTorchLLMRL.chat.tokenize import encode_prompt

    model, tok = load_calc()
    ctx = model.config.max_position_embeddings
    gen = ModelGenerate(model, tok, seed=0,
                        sampling=SamplingConfig(max_new_tokens=512, temperature=1.0, eos_token_ids=[10**6]))
    question = "Add the numbers: " + " + ".join(str(i % 10) for i in range(300))
    messages = [{"role": "user", "content": question}]
    prompt_len = len(encode_prompt(Rollout.from_chat(messages), tok))
    assert ctx - 512 < prompt_len < ctx - 8  # the default does not fit; some context is left
    with Gateway(gen).serve(host="127.0.0.1", port=0) as url:
        c = client(url, "long-1")
        reply = c.chat.completions.create(model="policy", messages=messages, extra_body={"return_token_ids": True})
        choice = reply.choices[0]
        assert choice.finish_reason == "length" and len(choice.token_ids) == ctx - prompt_len
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="policy", messages=messages, max_tokens=512)
        assert err.value.body["code"] == "context_length_exceeded"
