"""Weights for vLLM: full / merged-LoRA state dicts under the base names, and adapter export.

Pushed into the fake engine of tests/support/fake_vllm.py, whose `load_weights` raises
KeyError on any name that is not an HF checkpoint name and ValueError on a shape
mismatch; a recorder around it keeps the exact names and shapes that arrived.
One real-vLLM test at the end needs CUDA and the vllm extra.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from SimpleTorchLLMRL.model.generation.weight_sync import (
    LoraSpec,
    base_weights,
    export_adapter,
    merge_lora_weights,
    strip_peft_name,
    vllm_weights,
)
from SimpleTorchLLMRL.model.lora import apply_lora
from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer

PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("sync-base")
    tiny_model("qwen2", tok).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def shapes(sd):
    return {k: tuple(v.shape) for k, v in sd.items()}


def push(llm, weights: dict) -> list[tuple[str, tuple]]:
    """Load into the engine's model (as vLLM's apply_model does) and record what arrived, in order."""
    seen = []

    def load(model):
        items = list(weights.items())
        seen.extend((name, tuple(t.shape)) for name, t in items)
        return model.load_weights(items)

    llm.apply_model(load)
    return seen


def engine_logprobs(vllm, llm, n=6, lora_request=None):
    """Greedy continuation of PROMPT from the engine: (ids, per-token log-probs)."""
    params = vllm.SamplingParams(temperature=0.0, max_tokens=n, logprobs=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, lora_request=lora_request)[0].outputs[0]
    return out.token_ids, torch.tensor([d[t].logprob for d, t in zip(out.logprobs, out.token_ids, strict=True)])


def model_logprobs(model, ids) -> torch.Tensor:
    """Log-probs of `ids` after PROMPT under an HF / peft model (float64 softmax)."""
    full = torch.tensor([PROMPT + list(ids)])
    with torch.no_grad():
        logits = model(input_ids=full).logits[0, len(PROMPT) - 1: -1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)


def lora_policy(tok, seed=1, **kw):
    torch.manual_seed(seed)
    return apply_lora(tiny_model("qwen2", tok), r=4, alpha=16, init_lora_weights=False, **kw).eval()


def test_full_weights_are_the_base_names_and_shapes(vllm, tok, model_dir):
    base_sd = tiny_model("qwen2", tok).state_dict()
    trained = tiny_model("qwen2", tok, seed=7).eval()
    weights = vllm_weights(trained)
    assert shapes(weights) == shapes(base_sd) and list(weights) == list(base_sd)
    llm = vllm.LLM(model_dir)
    seen = push(llm, weights)
    assert seen == list(shapes(base_sd).items())  # exactly the base checkpoint's names and shapes, in order
    ids, lp = engine_logprobs(vllm, llm)
    assert torch.allclose(lp.double(), model_logprobs(trained, ids), atol=1e-5)


def test_merged_lora_weights_reach_the_engine(vllm, tok, model_dir):
    base_sd = tiny_model("qwen2", tok).state_dict()
    policy = lora_policy(tok)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    weights = vllm_weights(policy)
    assert shapes(weights) == shapes(base_sd)
    assert not any("lora" in k or "base_layer" in k or k.startswith("base_model") for k in weights)
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())  # nothing merged in place
    llm = vllm.LLM(model_dir)
    ids0, lp0 = engine_logprobs(vllm, llm)
    assert not torch.allclose(lp0.double(), model_logprobs(policy, ids0), atol=1e-3)  # engine had the base
    assert push(llm, weights) == list(shapes(base_sd).items())
    ids, lp = engine_logprobs(vllm, llm)
    assert torch.allclose(lp.double(), model_logprobs(policy, ids), atol=1e-5)


def test_base_only_drops_the_adapter(vllm, tok, model_dir):
    base = tiny_model("qwen2", tok)
    weights = vllm_weights(lora_policy(tok), merge_lora=False)
    assert shapes(weights) == shapes(base.state_dict())
    assert all(torch.equal(weights[k], v) for k, v in base.state_dict().items())


def test_adapter_export_serves_through_a_lora_request(vllm, tok, model_dir, tmp_path):
    policy = lora_policy(tok)
    path = export_adapter(policy, str(tmp_path / "step1"))
    tensors = load_file(f"{path}/adapter_model.safetensors")
    config = json.loads(open(f"{path}/adapter_config.json").read())
    assert config["r"] == 4 and config["lora_alpha"] == 16
    base_modules = dict(tiny_model("qwen2", tok).named_modules())
    for name, t in tensors.items():  # every adapter tensor sits on a base module, with matching shapes
        module, half = strip_peft_name(name).rsplit(".", 2)[0], name.split(".")[-2]
        assert half in ("lora_A", "lora_B") and module in base_modules, name
        w = base_modules[module].weight
        assert tuple(t.shape) == ((4, w.shape[1]) if half == "lora_A" else (w.shape[0], 4)), name
    assert len(tensors) == 2 * 7 * 2
    llm = vllm.LLM(model_dir, enable_lora=True)
    request = vllm.lora.request.LoRARequest("policy", 1, path)
    ids, lp = engine_logprobs(vllm, llm, lora_request=request)
    assert torch.allclose(lp.double(), model_logprobs(policy, ids), atol=1e-5)
    ids_base, lp_base = engine_logprobs(vllm, llm)  # base weights in the engine are untouched
    assert torch.allclose(lp_base.double(), model_logprobs(tiny_model("qwen2", tok), ids_base), atol=1e-5)


def test_modules_to_save_and_fan_in_fan_out(plain_tokenizer):
    """GPT-2: Conv1D weights are (in, out) and a fully trained ln_f replaces the frozen original."""
    base_sd = tiny_model("gpt2", plain_tokenizer).state_dict()
    torch.manual_seed(2)
    policy = apply_lora(tiny_model("gpt2", plain_tokenizer), r=4, alpha=8, init_lora_weights=False,
                        modules_to_save=["ln_f"]).eval()
    with torch.no_grad():
        policy.base_model.model.transformer.ln_f.modules_to_save["default"].weight.add_(0.5)
    weights = vllm_weights(policy)
    assert shapes(weights) == shapes(base_sd)
    assert torch.equal(weights["transformer.ln_f.weight"], base_sd["transformer.ln_f.weight"] + 0.5)
    plain = tiny_model("gpt2", plain_tokenizer)
    plain.load_state_dict(weights)
    ids = torch.randint(0, len(plain_tokenizer), (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, policy(input_ids=ids).logits, atol=1e-5)


def test_merge_from_a_plain_state_dict_against_float64():
    sd = {"base_model.model.lin.base_layer.weight": torch.randn(3, 5),
          "base_model.model.lin.base_layer.bias": torch.randn(3),
          "base_model.model.lin.lora_A.default.weight": torch.randn(2, 5),
          "base_model.model.lin.lora_B.default.weight": torch.randn(3, 2),
          "base_model.model.lin.lora_A.other.weight": torch.randn(2, 5),
          "base_model.model.lin.lora_B.other.weight": torch.randn(3, 2)}
    out = merge_lora_weights(sd, {"lin": LoraSpec(scaling=0.75)})
    assert list(out) == ["lin.weight", "lin.bias"]
    expect = sd["base_model.model.lin.base_layer.weight"].double() + 0.75 * (
        sd["base_model.model.lin.lora_B.default.weight"].double() @ sd["base_model.model.lin.lora_A.default.weight"].double())
    assert torch.allclose(out["lin.weight"].double(), expect, atol=1e-6)
    assert torch.equal(out["lin.bias"], sd["base_model.model.lin.base_layer.bias"])
    assert list(base_weights(sd)) == ["lin.weight", "lin.bias"]
    with pytest.raises(ValueError, match="LoraSpec"):
        merge_lora_weights(sd, {})
    half = {k: v for k, v in sd.items() if "lora_B.default" not in k}
    with pytest.raises(ValueError, match="lora_A and lora_B"):
        merge_lora_weights(half, {"lin": LoraSpec(1.0)})
    with pytest.raises(ValueError, match="4-bit"):
        merge_lora_weights({**sd, "base_model.model.lin.base_layer.weight.absmax": torch.ones(1)}, {})
    with pytest.raises(NotImplementedError, match="DoRA"):
        merge_lora_weights({**sd, "base_model.model.lin.lora_magnitude_vector.default.weight": torch.ones(3)},
                           {"lin": LoraSpec(1.0)})


def test_qlora_adapter_export_names_match_the_base(tok, model_dir, tmp_path):
    import os

    from SimpleTorchLLMRL.model.lora import load_qlora

    model = load_qlora(model_dir, r=4, alpha=8, init_lora_weights=False)
    path = export_adapter(model, str(tmp_path / "q"))
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    base_modules = dict(tiny_model("qwen2", tok).named_modules())
    assert len(tensors) == 2 * 7 * 2
    for name, t in tensors.items():
        module = strip_peft_name(name).rsplit(".", 2)[0]
        w = base_modules[module].weight
        assert t.dtype == torch.float32 and (t.shape[1] == w.shape[1] or t.shape[0] == w.shape[0]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                    reason="needs CUDA and the vllm extra (uv sync --extra vllm)")
def test_real_vllm_full_and_adapter_sync(tmp_path):  # pragma: no cover - GPU only
    import vllm as real_vllm
    from vllm.lora.request import LoRARequest

    from SimpleTorchLLMRL.model.generation.vllm import load_weights

    tok = tiny_tokenizer("chatml")
    # head_dim 64: vLLM's attention kernels do not take the default tiny model's 16
    base = tiny_model("qwen2", tok, hidden_size=128, num_heads=2)
    base.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    llm = real_vllm.LLM(str(tmp_path / "base"), enable_lora=True, max_lora_rank=8, gpu_memory_utilization=0.2,
                        enforce_eager=True, dtype="float32")
    torch.manual_seed(0)
    policy = apply_lora(tiny_model("qwen2", tok, hidden_size=128, num_heads=2), r=8, alpha=16,
                        init_lora_weights=False).eval()
    params = real_vllm.SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)

    def run(lora_request=None):
        out = llm.generate([{"prompt_token_ids": PROMPT}], params, lora_request=lora_request)[0].outputs[0]
        return out.token_ids, torch.tensor([d[t].logprob for d, t in zip(out.logprobs, out.token_ids, strict=True)])

    request = LoRARequest("policy", 1, export_adapter(policy, str(tmp_path / "adapter")))
    ids, lp = run(request)
    assert torch.allclose(lp.double(), model_logprobs(policy, list(ids)), atol=1e-3)
    load_weights(llm, vllm_weights(policy).items())
    ids, lp = run()
    assert torch.allclose(lp.double(), model_logprobs(policy, list(ids)), atol=1e-3)
