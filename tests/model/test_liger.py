"""model.scoring.liger: Liger-Kernel's body kernels swapped in, our head kept. Its kernels are CUDA-only (they do not
run in Triton's CPU interpreter), so here: what is patched, what is not, and the errors; benchmarks/gpu_check.py
compares log-probs and speed on a GPU."""

import pytest
import torch

pytest.importorskip("liger_kernel")

from liger_kernel.transformers.rms_norm import LigerRMSNorm  # noqa: E402
from liger_kernel.transformers.swiglu import LigerSwiGLUMLP  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402

from SimpleTorchLLMRL.model.lora import apply_lora  # noqa: E402
from SimpleTorchLLMRL.model.scoring.liger import apply_liger_kernels  # noqa: E402
from SimpleTorchLLMRL.testing.tiny import tiny_model  # noqa: E402


@pytest.mark.parametrize("lora", [False, True])
def test_the_body_is_patched_and_the_head_and_forward_are_not(lora, restore_qwen2, chatml_tokenizer):
    model = tiny_model("qwen2", chatml_tokenizer, hidden_size=64, num_layers=2)
    if lora:
        model = apply_lora(model, r=4, alpha=8)
    base = model.get_base_model() if lora else model
    head, forward = base.lm_head, type(base).forward
    assert apply_liger_kernels(model) is model
    body = base.model
    assert body.norm.forward.__func__ is LigerRMSNorm.forward
    for layer in body.layers:
        assert layer.input_layernorm.forward.__func__ is LigerRMSNorm.forward
        assert layer.post_attention_layernorm.forward.__func__ is LigerRMSNorm.forward
        assert layer.mlp.forward.__func__ is LigerSwiGLUMLP.forward
    assert modeling_qwen2.apply_rotary_pos_emb.__module__.startswith("liger_kernel")
    assert base.lm_head is head and type(base.lm_head) in (torch.nn.Linear, type(head))
    assert base.forward.__func__ is forward  # no fused linear cross-entropy forward: token_logprobs keeps its head


def test_only_what_is_asked_is_patched(restore_qwen2, chatml_tokenizer):
    model = tiny_model("qwen2", chatml_tokenizer, hidden_size=64, num_layers=2)
    rope = modeling_qwen2.apply_rotary_pos_emb
    apply_liger_kernels(model, rope=False, swiglu=False)
    assert modeling_qwen2.apply_rotary_pos_emb is rope
    assert model.model.norm.forward.__func__ is LigerRMSNorm.forward
    assert model.model.layers[0].mlp.forward.__func__ is not LigerSwiGLUMLP.forward


def test_an_architecture_liger_does_not_cover_is_refused(chatml_tokenizer):
    with pytest.raises(ValueError, match="no kernels for model_type 'gpt2'.*qwen2"):
        apply_liger_kernels(tiny_model("gpt2", chatml_tokenizer))


def test_without_liger_the_error_says_how_to_install(monkeypatch, chatml_tokenizer):
    import sys

    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    with pytest.raises(ImportError, match=r"SimpleTorchLLMRL\[liger\]"):
        apply_liger_kernels(tiny_model("qwen2", chatml_tokenizer))
