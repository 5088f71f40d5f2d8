"""LoRA helpers: which weights train, the disabled-adapter reference, save/load, merge for export."""

from __future__ import annotations

import pytest
import torch

from SimpleTorchLLMRL.model.lora import (
    adapter_disabled,
    apply_lora,
    is_peft_model,
    load_adapter,
    merge_for_export,
    save_adapter,
    trainable_parameter_names,
)
from SimpleTorchLLMRL.testing.tiny import tiny_model


def token_logprobs64(model, ids: torch.Tensor) -> torch.Tensor:
    """Naive reference: float64 log p(ids[:, t] | ids[:, :t]), (B, T) with column 0 = 0."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double()  # (B, T, V)
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    return torch.cat([torch.zeros(ids.shape[0], 1, dtype=lp.dtype), lp], 1)


def pg_step(model, ids: torch.Tensor, lr: float = 0.5) -> None:
    """One masked policy-gradient step (advantage +1 / -1 per row) with SGD on the trainable weights."""
    logits = model(input_ids=ids).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    adv = torch.tensor([1.0, -1.0])[: ids.shape[0], None]
    loss = -(lp * adv).mean()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def ids(chatml_tokenizer):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, len(chatml_tokenizer), (2, 12), generator=g)


def test_apply_lora_trains_only_adapters(qwen2_model):
    n_layers = qwen2_model.config.num_hidden_layers
    model = apply_lora(qwen2_model, r=4, alpha=8)
    assert is_peft_model(model)
    names = trainable_parameter_names(model)
    # all-linear: q k v o gate up down in every block, never the output head; A and B each
    assert len(names) == n_layers * 7 * 2
    assert all(".lora_A." in n or ".lora_B." in n for n in names)
    assert not any("lm_head" in n or "embed_tokens" in n for n in names)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.lora_A["default"].weight.shape == (4, qwen2_model.config.hidden_size)
    assert q.scaling["default"] == pytest.approx(8 / 4)


def test_fresh_adapter_is_the_base_model(chatml_tokenizer, ids):
    base = tiny_model("qwen2", chatml_tokenizer)
    model = apply_lora(tiny_model("qwen2", chatml_tokenizer), r=4)  # B = 0 at init: no change
    assert torch.equal(token_logprobs64(model, ids), token_logprobs64(base, ids))


def test_step_changes_only_adapters_and_disabled_adapter_is_the_base(chatml_tokenizer, ids):
    base = tiny_model("qwen2", chatml_tokenizer)
    model = apply_lora(tiny_model("qwen2", chatml_tokenizer), r=4, alpha=8).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pg_step(model, ids)
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_B." in k for k in changed)  # A gets no gradient while B == 0
    model.eval()
    trained = token_logprobs64(model, ids)
    assert (trained - token_logprobs64(base, ids)).abs().max() > 1e-4  # the adapter matters now
    with adapter_disabled(model):
        ref = token_logprobs64(model, ids)
    assert torch.equal(ref, token_logprobs64(base, ids))  # the reference is exactly the base model
    assert torch.equal(token_logprobs64(model, ids), trained)  # and the adapter is back on afterwards


def test_adapter_disabled_is_a_noop_without_peft(qwen2_model, ids):
    with adapter_disabled(qwen2_model):
        inside = token_logprobs64(qwen2_model, ids)
    assert torch.equal(inside, token_logprobs64(qwen2_model, ids))


def test_save_load_adapter_roundtrip(chatml_tokenizer, ids, tmp_path):
    model = apply_lora(tiny_model("qwen2", chatml_tokenizer), r=4, init_lora_weights=False)
    save_adapter(model, str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    loaded = load_adapter(tiny_model("qwen2", chatml_tokenizer), str(tmp_path / "adapter"), is_trainable=False)
    assert (token_logprobs64(loaded, ids) - token_logprobs64(model, ids)).abs().max() < 1e-5
    assert trainable_parameter_names(loaded) == []
    trainable = load_adapter(tiny_model("qwen2", chatml_tokenizer), str(tmp_path / "adapter"))
    assert trainable_parameter_names(trainable) == trainable_parameter_names(model)


@pytest.mark.parametrize("arch,style", [("qwen2", "chatml"), ("gpt2", "plain")])
def test_merge_for_export_matches_float64_reference(arch, style, request):
    tok = request.getfixturevalue(f"{style}_tokenizer")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, len(tok), (2, 10), generator=g)
    base = tiny_model(arch, tok)
    model = apply_lora(tiny_model(arch, tok), r=4, alpha=12, init_lora_weights=False)
    merged = merge_for_export(model)
    assert not is_peft_model(merged) and type(merged) is type(base)
    assert is_peft_model(model)  # not in place: training can go on
    assert list(merged.state_dict()) == list(base.state_dict())  # plain HF names
    assert (token_logprobs64(merged, ids) - token_logprobs64(model, ids)).abs().max() < 1e-5
    # one adapted weight against W + (alpha / r) B A in float64
    if arch == "qwen2":
        layer = model.base_model.model.model.layers[1].mlp.down_proj
        key, transpose = "model.layers.1.mlp.down_proj.weight", False
    else:  # GPT-2's Conv1D stores (in, out): peft marks it fan_in_fan_out
        layer = model.base_model.model.transformer.h[1].mlp.c_proj
        key, transpose = "transformer.h.1.mlp.c_proj.weight", True
    delta = layer.lora_B["default"].weight.double() @ layer.lora_A["default"].weight.double()
    expect = base.state_dict()[key].double() + (12 / 4) * (delta.T if transpose else delta)
    assert torch.allclose(merged.state_dict()[key].double(), expect, atol=1e-6, rtol=0)


def test_argument_checks(qwen2_model):
    for kwargs, name in [(dict(r=0), "r must"), (dict(alpha=-1), "alpha"), (dict(dropout=1.5), "dropout"),
                         (dict(target_modules=[]), "target_modules")]:
        with pytest.raises(ValueError, match=name):
            apply_lora(qwen2_model, **kwargs)
    model = apply_lora(qwen2_model, r=2)
    with pytest.raises(ValueError, match="already a PeftModel"):
        apply_lora(model)
    with pytest.raises(ValueError, match="PeftModel"):
        merge_for_export(tiny_model("llama"))
    with pytest.raises(ValueError, match="PeftModel"):
        save_adapter(tiny_model("llama"), "/nonexistent")
