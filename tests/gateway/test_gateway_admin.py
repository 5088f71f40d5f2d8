"""The session routes of a trainer in another process (GET /v1/sessions, POST /v1/sessions/{id}/finish), on only
with an admin key and refused without it, and `Gateway.take`: in process, and against the command-line gateway
feeding a GRPO step in this process through docs/environments.md's recipe. The real `openai` SDK and httpx on
127.0.0.1."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from SimpleTorchLLMRL import GRPO, ModelGenerate  # noqa: E402
from SimpleTorchLLMRL.chat.message import (  # noqa: E402
    MessageType,  # noqa: E402
    rollout_from_dict,
    rollout_to_dict,
)
from SimpleTorchLLMRL.chat.rollout_io import load_rollouts  # noqa: E402
from SimpleTorchLLMRL.chat.tokenize import encode_rollout  # noqa: E402
from SimpleTorchLLMRL.gateway import Gateway  # noqa: E402
from SimpleTorchLLMRL.gateway.sessions import SessionStore  # noqa: E402
from SimpleTorchLLMRL.recipes.calculator.arithmetic import CALCULATOR_SCHEMA  # noqa: E402
from SimpleTorchLLMRL.testing.tiny import TINY_CALC  # noqa: E402
from SimpleTorchLLMRL.tools import CalculatorError, evaluate  # noqa: E402
from tests.support.gateway_helpers import start  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-admin-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}


def gateway_of(calc, **kw) -> Gateway:
    model, tok = calc
    return Gateway(ModelGenerate(model, tok, max_new_tokens=8, temperature=1.0, seed=0), **kw)


def chat(url: str, session: str, n: int = 1, seed: int = 0) -> dict:
    body = {"model": "policy", "messages": start(), "n": n, "seed": seed, "return_token_ids": True}
    r = httpx.post(url + "/chat/completions", json=body, headers={"X-Session-Id": session}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# ----------------------------------------------------------------------------- in process


def test_take_returns_and_removes_sessions_and_writes_their_open_rollouts(calc, tmp_path):
    gw = gateway_of(calc, record_to=tmp_path / "r.jsonl")
    with gw.serve() as url:
        a, b = chat(url, "take-a", n=2), chat(url, "take-b")
    expected = {"take-a": gw.rollouts("take-a"), "take-b": gw.rollouts("take-b")}
    taken = gw.take(["take-a", "nobody"])
    assert list(taken) == ["take-a", "nobody"] and taken["nobody"] == []
    assert [r.to_dict() for r in taken["take-a"]] == [r.to_dict() for r in expected["take-a"]]
    assert [r[-1].token_ids for r in taken["take-a"]] == [c["token_ids"] for c in a["choices"]]
    assert gw.sessions() == ["take-b"] and gw.take(["take-a"]) == {"take-a": []}
    assert [r.to_dict() for r in gw.clear("take-b")] == [r.to_dict() for r in expected["take-b"]]
    assert b["choices"][0]["token_ids"] == expected["take-b"][0][-1].token_ids
    gw.close()
    assert len(load_rollouts(tmp_path / "r.jsonl")) == 3  # each rollout written once, when it was taken
    with pytest.raises(TypeError, match="session names"):
        gw.take([1])


def test_a_session_with_a_call_in_flight_is_not_taken():
    from SimpleTorchLLMRL.gateway.request import GenRequest
    from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig

    store = SessionStore()
    session, _ = store.open("busy", GenRequest(SamplingConfig(), messages=start()))
    with pytest.raises(ValueError, match=r"\['busy'\] have a call in flight"):
        store.take(["busy", "other"])
    store.release(session)  # no call recorded: dropped
    assert store.take(["busy"]) == {"busy": []}


def test_the_routes_answer_only_the_admin_key(calc):
    gw = gateway_of(calc, admin_key=KEY)
    with gw.serve() as url:
        reply = chat(url, "sess/1", n=2)
        chat(url, "sess-2")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"X-Session-Id": KEY}):
            for method, path in (("GET", "/sessions"), ("POST", "/sessions/sess-2/finish")):
                r = httpx.request(method, url + path, headers=headers, timeout=30)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (headers, path)
                assert r.json()["error"]["type"] == "authentication_error"
        listed = httpx.get(url + "/sessions", headers=ADMIN, timeout=30).json()["data"]
        assert [(s["id"], s["calls"], s["rollouts"], s["in_flight"]) for s in listed] == [("sess/1", 1, 2, 0),
                                                                                        ("sess-2", 1, 1, 0)]
        assert all(s["idle_seconds"] >= 0 for s in listed)
        expected = [rollout_to_dict(r) for r in gw.rollouts("sess/1")]
        done = httpx.post(url + "/sessions/sess/1/finish", headers=ADMIN, timeout=30).json()  # an id with a slash
        assert done["session"] == "sess/1" and done["data"] == expected
        assert [rollout_from_dict(d)[-1].token_ids for d in done["data"]] == [c["token_ids"] for c in reply["choices"]]
        gone = httpx.post(url + "/sessions/sess/1/finish", headers=ADMIN, timeout=30)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"
        assert [s["id"] for s in httpx.get(url + "/sessions", headers=ADMIN, timeout=30).json()["data"]] == ["sess-2"]
        assert httpx.get(url + "/sessions/sess-2/finish", headers=ADMIN, timeout=30).status_code == 405


def test_without_an_admin_key_the_routes_are_not_served(calc):
    gw = gateway_of(calc)
    with gw.serve() as url:
        chat(url, "open-1")
        for method, path in (("GET", "/sessions"), ("POST", "/sessions/open-1/finish")):
            r = httpx.request(method, url + path, headers=ADMIN, timeout=30)
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
            served = r.json()["error"]["message"].split("this gateway serves")[1]
            assert "/v1/chat/completions" in served and "/v1/sessions" not in served  # not among the routes named
    assert gw.sessions() == ["open-1"]
    with pytest.raises(ValueError, match="admin_key"):
        gateway_of(calc, admin_key=" ")


# ----------------------------------------------------------------------------- the command line and a trainer


def calculator(expression: str) -> str:
    try:
        return str(evaluate(expression))
    except CalculatorError as e:
        return f"Error: {e}"


def episode(url: str, session: str, question: str, seed: int) -> list[list[int]]:
    """A tool-calling agent (the OpenAI SDK only), naming its session; the ids each of its replies carried."""
    client = openai.OpenAI(base_url=url, api_key="agent", default_headers={"X-Session-Id": session}, max_retries=0)
    messages = [start(question)[0], start(question)[1]]
    sampled = []
    for turn in range(2):
        r = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_SCHEMA],
                                           seed=seed + turn, extra_body={"return_token_ids": True})
        sampled.append(r.choices[0].model_extra["token_ids"])
        reply = r.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(str(args.get(
                "expression", "")))})
    return sampled


def start_cli(*flags: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "SimpleTorchLLMRL.gateway", "--model", str(TINY_CALC), "--port",
                             "0", "--max-new-tokens", "40", *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    line = proc.stdout.readline()
    while line and "serving" not in line:
        line = proc.stdout.readline()
    assert "http://127.0.0.1:" in line, line
    return proc, line.split(" at ")[-1].strip()


def docs_recipe() -> str:
    from tests.project.test_docs import python_blocks

    [code] = [code for _, info, _, code in python_blocks(ROOT / "docs" / "environments.md")
              if info == "python no-run" and "test_gateway_admin" in code.splitlines()[0]]
    return code


def test_a_command_line_gateway_feeds_a_trainer_in_another_process(calc, monkeypatch):
    proc, url = start_cli("--admin-key", KEY)
    try:
        assert httpx.get(url + "/sessions", timeout=30).status_code == 401  # no key: refused
        questions = {"q0": "What is 645 * 49?", "q1": "What is 91 * 43?"}
        sent = {f"{task}-{k}": episode(url, f"{task}-{k}", q, seed=10 * k)
                for task, q in questions.items() for k in range(3)}
        monkeypatch.setenv("GATEWAY_URL", url)
        monkeypatch.setenv("GATEWAY_ADMIN_KEY", KEY)
        namespace = {"__name__": "__main__"}
        exec(compile(docs_recipe(), "docs/environments.md (trainer)", "exec"), namespace)  # the recipe, as written
        assert httpx.get(url + "/sessions", headers=ADMIN, timeout=30).json()["data"] == []  # all taken
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    rollouts = namespace["rollouts"]
    assert sorted(r.metadata["session"] for r in rollouts) == sorted(sent)  # one rollout per episode, each once
    _, tok = calc
    model = namespace["model"]
    model.load_state_dict(calc[0].state_dict())  # the server's weights (the recipe stepped its copy)
    for r in rollouts:
        assert [m.token_ids for m in r if m.type is MessageType.MODEL] == sent[r.metadata["session"]]
        enc = encode_rollout(r, tok)  # the other process's ids and log-probs, exact here
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([enc.input_ids])).logits[0, :-1].double()  # (T-1, V)
        mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(enc.input_ids[1:])[:, None])[:, 0]
        at = [t for t, k in enumerate(enc.loss_mask) if k]
        assert mine[[t - 1 for t in at]].tolist() == pytest.approx([enc.sampler_logprobs[t] for t in at], abs=2e-4)
    # a GRPO step on them in this process: a reward with spread in each group (sampled length), a gradient
    grpo = GRPO(model, tok, temperature=1.0)
    rewards = torch.tensor([float(sum(len(m.token_ids) for m in r if m.type is MessageType.MODEL)) for r in rollouts])
    grpo.calculate_loss(rollouts, rewards).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
    assert 0 < norm < float("inf")
