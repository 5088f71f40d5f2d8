"""The gateway's routes besides chat (GET /v1/models/{id}, POST /v1/completions) and every error in
OpenAI's shape (unknown routes, wrong methods, validation, uvicorn's own 400), driven over 127.0.0.1
by the real `openai` SDK, raw httpx requests and a raw socket."""

import socket

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")


from SimpleTorchLLMRL.gateway import Gateway  # noqa: E402

# raw text in the tiny model's chat format: a prompt it continues for several tokens
PROMPT = "<|im_start|>user\nWhat is 645 * 49?<|im_end|>\n<|im_start|>assistant\n"

SERVED = dict(max_new_tokens=12)  # the `served` gateway's sampling (tests/gateway/conftest.py)


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=served[1], api_key="routes", max_retries=0)


def origin(url: str) -> str:
    return url.removesuffix("/v1")


def openai_error(r: httpx.Response, status: int) -> dict:
    """The response's OpenAI error object, after checking the status and the shape."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def greedy(model, ids: list[int], steps: int) -> list[int]:
    """The naive reference: argmax decoding, one full forward per token."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


# ----------------------------------------------------------------------------- errors in OpenAI's shape


@pytest.mark.parametrize("method,path", [("POST", "/v1/audio/speech"), ("GET", "/v1/nothing"), ("GET", "/"),
                                         ("POST", "/v1/embeddings")])
def test_unknown_route_is_an_openai_404_naming_it(served, method, path):
    r = httpx.request(method, origin(served[1]) + path, json={"model": "policy", "input": "hi"}, timeout=30)
    err = openai_error(r, 404)
    assert f"{method} {path}" in err["message"]
    assert err["type"] == "invalid_request_error"
    assert "/v1/chat/completions" in err["message"]  # says what is served


@pytest.mark.parametrize("method,path,allow", [("GET", "/v1/chat/completions", "POST"),
                                               ("GET", "/v1/completions", "POST"),
                                               ("GET", "/v1/responses", "POST"),
                                               ("DELETE", "/v1/models", "GET"), ("POST", "/health", "GET"),
                                               ("PUT", "/v1/models/policy", "GET")])
def test_wrong_method_is_an_openai_405(served, method, path, allow):
    r = httpx.request(method, origin(served[1]) + path, timeout=30)
    err = openai_error(r, 405)
    assert method in err["message"] and path in err["message"]
    assert allow in r.headers["allow"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"model": "policy"}'])
def test_malformed_request_is_an_openai_400(served, path, body):
    r = httpx.post(served[1].removesuffix("/v1") + path, content=body, timeout=30,
                   headers={"content-type": "application/json"})
    assert openai_error(r, 400)["type"] == "invalid_request_error"


def test_fastapi_validation_error_is_a_400_not_a_422(served):
    """FastAPI's RequestValidationError (a typed parameter) answers 400 in OpenAI's shape, naming the field."""
    from fastapi.testclient import TestClient

    app = Gateway(served[0].generator).app()  # its own gateway: no lifespan, the served batcher untouched

    @app.get("/typed")
    async def typed(limit: int):
        return {"limit": limit}

    tc = TestClient(app)
    assert tc.get("/typed", params={"limit": 3}).json() == {"limit": 3}
    err = openai_error(tc.get("/typed", params={"limit": "many"}), 400)
    assert err["param"] == "limit" and "limit" in err["message"]
    err = openai_error(tc.get("/typed"), 400)
    assert err["param"] == "limit"


def test_uvicorns_own_400_for_a_malformed_http_request(served):
    """Bytes that are not HTTP never reach the app: uvicorn answers them itself, here in OpenAI's shape."""
    host, port = served[1].removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"NOT HTTP AT ALL\x00\x01\r\n\r\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), raw
    r = httpx.Response(400, headers=[tuple(line.split(b": ", 1)) for line in head.split(b"\r\n")[1:]], content=body)
    openai_error(r, 400)
    # and the server still serves
    assert httpx.get(origin(served[1]) + "/health", timeout=30).json() == {"status": "ok"}


# ----------------------------------------------------------------------------- GET /v1/models/{id}


def test_models_retrieve_through_the_sdk(client):
    m = client.models.retrieve("policy")
    assert (m.id, m.object, m.owned_by) == ("policy", "model", "SimpleTorchLLMRL")
    assert [x.id for x in client.models.list()] == ["policy"]


@pytest.mark.parametrize("name", ["gpt-4o", "org/some-model", "policy-2"])
def test_models_retrieve_unknown_is_not_found(client, served, name):
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve(name)
    assert e.value.body["code"] == "model_not_found" and name in e.value.body["message"]
    err = openai_error(httpx.get(f"{served[1]}/models/{name}", timeout=30), 404)
    assert (err["code"], err["param"]) == ("model_not_found", "model")


# ----------------------------------------------------------------------------- POST /v1/completions


def test_completion_is_the_raw_prompt_continued_without_a_chat_template(client, calc):
    """temperature 0: exactly the greedy continuation of the prompt's own ids (no template around them)."""
    model, tok = calc
    r = client.completions.create(model="policy", prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.object == "text_completion" and r.model == "policy" and r.id.startswith("cmpl-")
    [choice] = r.choices
    ids = tok(PROMPT)["input_ids"]
    sampled = choice.model_extra["token_ids"]
    assert r.model_extra["prompt_token_ids"] == [ids]
    assert sampled == greedy(model, ids, len(sampled))
    assert choice.text == tok.decode(sampled, skip_special_tokens=True)
    assert choice.finish_reason in ("stop", "length") and choice.index == 0
    if choice.finish_reason == "length":
        assert len(sampled) == 6
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(sampled))
    assert r.usage.total_tokens == len(ids) + len(sampled)


def test_completion_prompts_times_n_and_seed(client, calc):
    _, tok = calc
    prompts = [PROMPT, "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"]
    kw = dict(model="policy", prompt=prompts, n=2, max_tokens=8, temperature=1.0, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]  # prompt-major, as OpenAI orders them
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # the seed fixes the samples
    assert a.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in prompts)
    # token ids as the prompt, one prompt or several
    ids = tok(PROMPT)["input_ids"]
    c = client.completions.create(model="policy", prompt=ids, max_tokens=4, temperature=0)
    d = client.completions.create(model="policy", prompt=[ids, ids], max_tokens=4, temperature=0)
    e = client.completions.create(model="policy", prompt=PROMPT, max_tokens=4, temperature=0)
    assert c.choices[0].text == e.choices[0].text == d.choices[0].text == d.choices[1].text


def test_completion_stop_stream_and_logprobs(client, calc):
    _, tok = calc
    kw = dict(model="policy", prompt=PROMPT, max_tokens=10, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 2
    cut = client.completions.create(**kw, stop=[full[2:4]]).choices[0]
    assert cut.finish_reason == "stop" and full[2:4] not in cut.text and full.startswith(cut.text)
    streamed = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full
    assert streamed[-1].usage.completion_tokens > 0
    r = client.completions.create(**kw, logprobs=2, extra_body={"return_token_ids": True})
    lp, ids = r.choices[0].logprobs, r.choices[0].model_extra["token_ids"]
    assert lp.tokens == [tok.decode([t]) for t in ids] and len(lp.token_logprobs) == len(ids)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and all(x <= 0 for x in lp.token_logprobs)
    # the greedy token is the most likely one: its log-prob is the best of its top alternatives
    assert all(max(top.values()) == pytest.approx(v, abs=1e-4) for top, v in zip(lp.top_logprobs, lp.token_logprobs,
                                                                                 strict=True))


@pytest.mark.parametrize("extra,param", [({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"),
                                         ({"logit_bias": {"30": -200}}, "logit_bias"),
                                         ({"logit_bias": {"-1": 5}}, "logit_bias"),
                                         ({"presence_penalty": 2.5}, "presence_penalty"),
                                         ({"frequency_penalty": "1"}, "frequency_penalty"),
                                         ({"best_of": 3}, "best_of"), ({"n": 0}, "n"), ({"logprobs": 9}, "logprobs"),
                                         ({"temperature": 3}, "temperature"), ({"prompt": ""}, "prompt"),
                                         ({"prompt": [[1, 10**9]]}, "prompt"), ({"prompt": {"a": 1}}, "prompt"),
                                         ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
                                         ({"max_tokens": 100000}, "prompt")])
def test_completion_fields_not_honoured_are_refused_by_name(client, served, extra, param):
    body = {"model": "policy", "prompt": PROMPT, "max_tokens": 4} | extra
    err = openai_error(httpx.post(f"{served[1]}/completions", json=body, timeout=30), 400)
    assert err["param"] == param, err
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**body)


def test_completion_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_completions_are_not_recorded(client, served):
    gw = served[0]
    c = openai.OpenAI(base_url=served[1], api_key="text-only", max_retries=0)
    c.completions.create(model="policy", prompt=PROMPT, max_tokens=3)
    assert "text-only" not in gw.sessions()
