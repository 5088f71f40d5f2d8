"""QLoRA on CPU (bitsandbytes >= 0.50 runs 4-bit NF4 there): a GRPO step, the reference, save/load.

The base checkpoint is a tiny random Qwen2 saved to a temporary directory and
loaded back through `load_qlora` (BitsAndBytesConfig nf4 + double quantization).
"""

from __future__ import annotations

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.model.lora import (
    adapter_disabled,
    bnb_4bit_config,
    is_quantized,
    load_adapter,
    load_qlora,
    merge_for_export,
    save_adapter,
    trainable_parameter_names,
)
from SimpleTorchLLMRL.model.scoring.logprobs import token_logprobs
from SimpleTorchLLMRL.testing.tiny import tiny_model
from SimpleTorchLLMRL.trainer.grpo import GRPO

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # bitsandbytes / peft CPU notices


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, chatml_tokenizer):
    path = tmp_path_factory.mktemp("qlora_base")
    tiny_model("qwen2", chatml_tokenizer).save_pretrained(path)
    return str(path)


def load_4bit_base(path):
    from transformers import AutoModelForCausalLM

    from SimpleTorchLLMRL.model.lora import keep_cpu_4bit_differentiable

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb_4bit_config(), dtype=torch.float32)
    keep_cpu_4bit_differentiable(model)
    return model.eval()


def rollouts_and_rewards(tokenizer, groups: int = 2, group_size: int = 2):
    g = torch.Generator().manual_seed(11)
    low = len(tokenizer.all_special_ids)
    rollouts = []
    for k in range(groups):
        for _ in range(group_size):
            ids = torch.randint(low, len(tokenizer), (6,), generator=g).tolist()
            rollouts.append(Rollout([Message(f"Add {k} and {k + 1}."),
                                     Message(tokenizer.decode(ids), MessageType.MODEL, token_ids=ids)]))
    return rollouts, torch.tensor([1.0, 0.0, 0.0, 1.0])[: len(rollouts)]


def grpo_step(model, tokenizer, rollouts, rewards, lr=1e-2):
    """One GRPO step with a KL term (reference = the disabled adapter); returns the GRPO object."""
    grpo = GRPO(model, tokenizer, beta=0.1, group_size=2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    loss = grpo.calculate_loss(rollouts, rewards)
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()
    return grpo, loss


def batch_logprobs(model, tokenizer, rollouts):
    from SimpleTorchLLMRL.chat.tokenize import rollouts_to_batch

    batch = rollouts_to_batch(rollouts, tokenizer)
    with torch.no_grad():
        return token_logprobs(model, batch, positions=batch.loss_mask), batch


def test_load_qlora_is_nf4_double_quant(base_dir):
    model = load_qlora(base_dir, r=4, alpha=8)
    import bitsandbytes as bnb

    four_bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 2 * 7  # every block linear; embeddings and head stay float
    state = four_bit[0].weight.quant_state
    assert state.quant_type == "nf4" and state.nested  # nested = double quantization
    assert is_quantized(model)
    names = trainable_parameter_names(model)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if p.requires_grad)
    # CPU repacking for inference is switched off (see keep_cpu_4bit_differentiable)
    assert not any(getattr(m, "support_avx512bf16_for_cpu", False) for m in four_bit)


def test_grpo_step_changes_only_adapter_weights(base_dir, chatml_tokenizer):
    model = load_qlora(base_dir, r=4, alpha=8)
    rollouts, rewards = rollouts_and_rewards(chatml_tokenizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grpo, loss = grpo_step(model, chatml_tokenizer, rollouts, rewards)
    assert torch.isfinite(loss) and "kl" in grpo.metrics
    after = model.state_dict()
    assert list(after) == list(before)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    # lora_B moves (lora_A gets no gradient while B is still 0); the 4-bit weights, their
    # quantization state, norms and embeddings are bit-for-bit what was loaded
    assert changed and all(".lora_B." in k for k in changed), sorted(changed)[:5]
    assert any(k.endswith(".weight.absmax") or "quant_state" in k for k in after)


def test_disabled_adapter_reference_is_the_4bit_base(base_dir, chatml_tokenizer):
    model = load_qlora(base_dir, r=4, alpha=8)
    rollouts, rewards = rollouts_and_rewards(chatml_tokenizer)
    grpo_step(model, chatml_tokenizer, rollouts, rewards)
    base = load_4bit_base(base_dir)
    base_lp, batch = batch_logprobs(base, chatml_tokenizer, rollouts)
    trained_lp, _ = batch_logprobs(model, chatml_tokenizer, rollouts)
    assert (trained_lp - base_lp).abs().max() > 1e-4  # the trained adapter changes the policy
    with adapter_disabled(model):
        disabled_lp, _ = batch_logprobs(model, chatml_tokenizer, rollouts)
    assert torch.allclose(disabled_lp, base_lp, atol=1e-6, rtol=0)
    # what GRPO itself uses as the reference (its KL term) is the same tensor
    prepared = GRPO(model, chatml_tokenizer, beta=0.1, group_size=2).prepare(rollouts, rewards)
    mask = prepared.mask.bool()
    assert torch.allclose(prepared.ref_logprobs[mask], base_lp[mask], atol=1e-6, rtol=0)
    # and the 4-bit base is the float model up to quantization error, not something else
    float_lp, _ = batch_logprobs(tiny_model("qwen2", chatml_tokenizer), chatml_tokenizer, rollouts)
    assert 0 < (float_lp - base_lp)[mask].abs().max() < 0.5


def test_adapter_save_load_reproduces_logprobs(base_dir, chatml_tokenizer, tmp_path):
    model = load_qlora(base_dir, r=4, alpha=8)
    rollouts, rewards = rollouts_and_rewards(chatml_tokenizer)
    grpo_step(model, chatml_tokenizer, rollouts, rewards)
    trained_lp, _ = batch_logprobs(model, chatml_tokenizer, rollouts)
    save_adapter(model, str(tmp_path / "adapter"))
    loaded = load_adapter(load_4bit_base(base_dir), str(tmp_path / "adapter"), is_trainable=False).eval()
    loaded_lp, _ = batch_logprobs(loaded, chatml_tokenizer, rollouts)
    assert (loaded_lp - trained_lp).abs().max() < 1e-5


def test_gradients_survive_an_eval_forward(base_dir):
    """bitsandbytes repacks CPU 4-bit weights on the first eval/no-grad forward; gradients must not change."""
    ids = torch.randint(0, 400, (2, 10), generator=torch.Generator().manual_seed(0))

    def grads(warm_up_in_eval: bool):
        torch.manual_seed(0)  # the same random adapter both times
        model = load_qlora(base_dir, r=4, alpha=8, init_lora_weights=False)
        if warm_up_in_eval:  # what GRPO does for old / reference log-probs
            model.eval()
            with torch.no_grad():
                model(input_ids=ids)
        model.train()
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, after_eval = grads(False), grads(True)
    assert list(plain) == list(after_eval) and len(plain) == 2 * 7 * 2
    for name in plain:
        assert torch.allclose(plain[name], after_eval[name], atol=1e-7, rtol=1e-5), name


def test_qlora_refuses_lossy_merges(base_dir):
    from SimpleTorchLLMRL.model.generation.weight_sync import vllm_weights

    model = load_qlora(base_dir, r=4, alpha=8)
    with pytest.raises(ValueError, match="4-bit"):
        merge_for_export(model)
    with pytest.raises(ValueError, match="adapter"):
        vllm_weights(model)
    with pytest.raises(ValueError, match="compute_dtype"):
        load_qlora(base_dir, compute_dtype="int8")
    with pytest.raises(ValueError, match="quantization_config"):
        load_qlora(base_dir, model_kwargs={"quantization_config": None})
