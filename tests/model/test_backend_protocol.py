"""The `Backend` protocol (model/generation/sampling.py) is what callers use of a backend: both backends define all of
it, the gateway asks nothing outside it, and the top-log-prob scoring it declares is right."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch

import SimpleTorchLLMRL
from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
from SimpleTorchLLMRL.model.generation.hf_backend import HFBackend
from SimpleTorchLLMRL.model.generation.sampling import Backend
from SimpleTorchLLMRL.model.generation.vllm import VLLMBackend
from SimpleTorchLLMRL.testing.tiny import tiny_model
from tests.support.fake_vllm import install_fake_vllm
from tests.support.generation_helpers import peaked

GATEWAY = Path(SimpleTorchLLMRL.__file__).parent / "gateway"


def protocol_members() -> set[str]:
    names = {n for n in vars(Backend) if not n.startswith("_")}
    return names | set(Backend.__annotations__)


def test_the_protocol_declares_what_callers_use():
    assert {"generate", "check_sampling", "mixed_adapters", "supports_top_logprobs", "top_logprobs",
            "logprob_temperature_for", "max_context", "push_weights"} <= protocol_members()


@pytest.fixture(scope="module")
def policy(tok):
    return peaked(tiny_model("qwen2", tok), seed=0)


def test_both_backends_define_every_member(monkeypatch, tmp_path, tok, policy):
    policy.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    vllm = install_fake_vllm(monkeypatch)
    backends = [ModelGenerate(policy,
                              tok).backend, ModelGenerate(vllm.LLM(str(tmp_path)), tok,
                                                          temperature=1.0).backend]
    assert [type(b) for b in backends] == [HFBackend, VLLMBackend]
    for backend in backends:
        missing = sorted(n for n in protocol_members() if not hasattr(backend, n))
        assert missing == [], (type(backend).__name__, missing)
    assert [(b.mixed_adapters, b.supports_top_logprobs) for b in backends] == [(False, True), (True, False)]
    with pytest.raises(ValueError, match="need the HF backend"):
        backends[1].top_logprobs([1, 2], [3], 1.0, 2)


def _sniffs_a_backend(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"hasattr", "getattr"}
            and bool(node.args) and "backend" in ast.unparse(node.args[0]))


def test_the_gateway_never_sniffs_the_backend():
    found = [f"{p.name}:{n.lineno}" for p in sorted(GATEWAY.glob("*.py"))
             for n in ast.walk(ast.parse(p.read_text())) if _sniffs_a_backend(n)]
    assert found == []
    assert _sniffs_a_backend(ast.parse('hasattr(generator.backend, "model")').body[0].value)


def test_hf_top_logprobs_match_a_float64_reference(tok, policy):
    backend = ModelGenerate(policy, tok).backend
    prompt, reply, temperature = [5, 9, 14, 3], [7, 21, 2], 0.7
    top = backend.top_logprobs(prompt, reply, temperature, 3)
    with torch.no_grad():
        logits = copy.deepcopy(policy).double()(input_ids=torch.tensor([prompt + reply])).logits[0, len(prompt) - 1: -1]
    ref = torch.log_softmax(logits / temperature, dim=-1).topk(3, dim=-1)  # (N, 3)
    assert [[i for i, _ in row] for row in top] == ref.indices.tolist()
    assert torch.allclose(torch.tensor([[v for _, v in row] for row in top], dtype=torch.float64), ref.values,
                          atol=1e-5)


def test_a_gateway_over_vllm_refuses_top_logprobs_by_the_protocol(monkeypatch, tmp_path, tok, policy):
    from SimpleTorchLLMRL.gateway import chat
    from SimpleTorchLLMRL.gateway.request import RequestError
    from SimpleTorchLLMRL.gateway.server import Gateway

    policy.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    gateway = Gateway(ModelGenerate(install_fake_vllm(monkeypatch).LLM(str(tmp_path)), tok, temperature=1.0))
    assert gateway.supports_top_logprobs is False  # read from the backend's protocol attribute
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    with pytest.raises(RequestError, match="top_logprobs needs the HF backend") as info:
        chat.parse(body, gateway)
    assert info.value.param == "top_logprobs"
    assert chat.parse({**body, "top_logprobs": 0}, gateway).top_logprobs == 0

