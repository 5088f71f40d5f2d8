"""model.scoring.liger: Liger-Kernel's body kernels in the training forwards, HF's in the decode, our head kept. Its
kernels are CUDA-only (they do not run in Triton's CPU interpreter), so here: what is patched, what is not, the
errors, and which forward runs which module, with Liger's functions replaced by recording stand-ins that compute
HF's math; benchmarks/gpu_check.py compares log-probs and speed on a GPU."""

import pytest
import torch

pytest.importorskip("liger_kernel")

from liger_kernel.transformers.rms_norm import LigerRMSNorm  # noqa: E402
from liger_kernel.transformers.swiglu import LigerSwiGLUMLP  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402

from SimpleTorchLLMRL.model.lora import apply_lora  # noqa: E402
from SimpleTorchLLMRL.model.scoring.liger import _dispatching_forward, apply_liger_kernels  # noqa: E402
from SimpleTorchLLMRL.testing.tiny import tiny_model  # noqa: E402


@pytest.mark.parametrize("lora", [False, True])
def test_the_body_is_patched_and_the_head_and_forward_are_not(lora, restore_qwen2, chatml_tokenizer):
    model = tiny_model("qwen2", chatml_tokenizer, hidden_size=64, num_layers=2)
    if lora:
        model = apply_lora(model, r=4, alpha=8)
    base = model.get_base_model() if lora else model
    head, forward = base.lm_head, type(base).forward
    rope = modeling_qwen2.apply_rotary_pos_emb
    assert apply_liger_kernels(model) is model
    body = base.model
    for norm in (body.norm, *(m for layer in body.layers for m in (layer.input_layernorm,
                                                                 layer.post_attention_layernorm))):
        assert norm.forward.__func__ is _dispatching_forward and norm._liger_forward.__func__ is LigerRMSNorm.forward
        assert norm._get_name() == "Qwen2RMSNorm"  # HF's names kept
    for layer in body.layers:
        assert layer.mlp._liger_forward.__func__ is LigerSwiGLUMLP.forward
        assert layer.mlp._plain_forward.__func__ is modeling_qwen2.Qwen2MLP.forward
    liger_rope, plain_rope = modeling_qwen2.apply_rotary_pos_emb._liger_pair
    assert liger_rope.__module__.startswith("liger_kernel") and plain_rope is rope
    assert modeling_qwen2.Qwen2RMSNorm is not LigerRMSNorm  # models built later are HF's
    assert base.lm_head is head and type(base.lm_head) in (torch.nn.Linear, type(head))
    assert base.forward.__func__ is forward  # no fused linear cross-entropy forward: token_logprobs keeps its head


def test_only_what_is_asked_is_patched(restore_qwen2, chatml_tokenizer):
    model = tiny_model("qwen2", chatml_tokenizer, hidden_size=64, num_layers=2)
    rope = modeling_qwen2.apply_rotary_pos_emb
    apply_liger_kernels(model, rope=False, swiglu=False)
    assert modeling_qwen2.apply_rotary_pos_emb is rope
    assert model.model.norm._liger_forward.__func__ is LigerRMSNorm.forward
    assert "forward" not in vars(model.model.layers[0].mlp)


def test_an_architecture_liger_does_not_cover_is_refused(chatml_tokenizer):
    with pytest.raises(ValueError, match="no kernels for model_type 'gpt2'.*qwen2"):
        apply_liger_kernels(tiny_model("gpt2", chatml_tokenizer))


def test_without_liger_the_error_says_how_to_install(monkeypatch, chatml_tokenizer):
    import sys

    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    with pytest.raises(ImportError, match=r"SimpleTorchLLMRL\[liger\]"):
        apply_liger_kernels(tiny_model("qwen2", chatml_tokenizer))


# ---------------------------------------------------------------- which forward runs which module


@pytest.fixture
def recording(monkeypatch, restore_qwen2):
    """Liger's RMSNorm, SwiGLU and RoPE replaced by stand-ins that record their calls and compute HF's math (the
    real ones need CUDA): what `apply_liger_kernels` binds is what it finds on Liger's classes and module."""
    from liger_kernel.transformers import monkey_patch

    calls = {"rms_norm": 0, "swiglu": 0, "rope": 0}
    rope = modeling_qwen2.apply_rotary_pos_emb

    def rms_norm(self, hidden_states):
        calls["rms_norm"] += 1
        return modeling_qwen2.Qwen2RMSNorm.forward(self, hidden_states)

    def swiglu(self, x):
        calls["swiglu"] += 1
        return modeling_qwen2.Qwen2MLP.forward(self, x)

    def liger_rope(*args, **kwargs):
        calls["rope"] += 1
        return rope(*args, **kwargs)

    monkeypatch.setattr(LigerRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(LigerSwiGLUMLP, "forward", swiglu)
    monkeypatch.setattr(monkey_patch, "liger_rotary_pos_emb", liger_rope)
    return calls


def _rollouts(tok):
    from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout

    return [Rollout([Message(q), Message(a, MessageType.MODEL)]) for q, a in
            (("What is 2 + 3?", "5"), ("What is 7 * 8?", "It is 56."), ("Name a color.", "Blue, I think."))]


def test_the_decode_runs_hfs_modules_and_the_trainer_ligers(recording, chatml_tokenizer):
    import copy

    from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
    from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
    from SimpleTorchLLMRL.model.scoring.logprobs import token_logprobs
    from SimpleTorchLLMRL.trainer.grpo import GRPO

    tok = chatml_tokenizer
    model = tiny_model("qwen2", tok, hidden_size=64, num_layers=2)
    plain = copy.deepcopy(model)
    apply_liger_kernels(model)

    def decode(m):  # a group of 2 per prompt too: the HF backend prefills each prompt once (`_shared_prefill`)
        gen = ModelGenerate(m, tok, sampling=SamplingConfig(max_new_tokens=6, do_sample=False))
        rollouts = _rollouts(tok)
        return [msg.token_ids for g in gen.generate(rollouts) + gen.generate(rollouts[:1], n=2) for msg in g]

    assert decode(model) == decode(plain)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))  # any forward without grad outside the trainer: HF's
    assert recording == {"rms_norm": 0, "swiglu": 0, "rope": 0}

    rollouts, rewards = _rollouts(tok), [1.0, 0.0, 0.5]
    losses = []
    for m in (model, plain):
        loss = GRPO(m, tok, group_size=3).calculate_loss(rollouts, rewards)
        loss.backward()
        losses.append(loss.detach())
    per_forward = {"rms_norm": 2 * 2 + 1, "swiglu": 2, "rope": 2}  # 2 layers
    assert all(recording[k] >= per_forward[k] for k in recording), recording
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)

    seen = dict(recording)
    from SimpleTorchLLMRL.chat.tokenize import rollouts_to_batch

    with torch.no_grad():  # a scoring forward without grad (the old / reference passes): Liger's
        token_logprobs(model, rollouts_to_batch(rollouts, tok))
    assert all(recording[k] > seen[k] for k in recording)


def test_a_checkpointed_layer_recomputes_with_ligers_kernels_in_backward(recording, chatml_tokenizer):
    import copy

    from SimpleTorchLLMRL.trainer.grpo import GRPO

    tok = chatml_tokenizer
    model = tiny_model("qwen2", tok, hidden_size=64, num_layers=2).train()
    plain = copy.deepcopy(model)
    for m in (model, plain):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_liger_kernels(model)
    rollouts = _rollouts(tok)
    loss = GRPO(model, tok, group_size=3).calculate_loss(rollouts, [1.0, 0.0, 0.5])
    before = dict(recording)
    loss.backward()  # the recomputation runs Liger's forward again (HF's would save other tensors)
    assert recording["rms_norm"] > before["rms_norm"] and recording["swiglu"] > before["swiglu"]
    GRPO(plain, tok, group_size=3).calculate_loss(rollouts, [1.0, 0.0, 0.5]).backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_copy_of_a_patched_model_runs_its_own_weights_and_patching_twice_changes_nothing(recording,
                                                                                       chatml_tokenizer):
    import copy

    model = tiny_model("qwen2", chatml_tokenizer, hidden_size=64, num_layers=2)
    apply_liger_kernels(model)
    rope = modeling_qwen2.apply_rotary_pos_emb
    apply_liger_kernels(model)
    assert modeling_qwen2.apply_rotary_pos_emb is rope and model.model.norm._liger_forward.__self__ is model.model.norm
    twin = copy.deepcopy(model)
    assert twin.model.norm._liger_forward.__self__ is twin.model.norm
    assert twin.model.norm._plain_forward.__self__ is twin.model.norm
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(0.1)
    ids = torch.tensor([[5, 6, 7, 8]])
    reference = tiny_model("qwen2", chatml_tokenizer, hidden_size=64, num_layers=2)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.1)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(twin(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)
