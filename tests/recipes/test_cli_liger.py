"""main.py --liger: Liger's body kernels on CUDA where they cover the model, never silently on CPU."""

import argparse

import pytest

from SimpleTorchLLMRL.recipes.calculator.cli import UsageError, body_kernels, parse_args, resolve_device
from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer


def _args(liger: str, device: str, backend: str = "vllm") -> argparse.Namespace:
    return argparse.Namespace(liger=liger, device=device, backend=backend)


def test_default_is_auto_and_cpu_runs_leave_the_model_alone():
    assert parse_args([]).liger == "auto"
    model = tiny_model("qwen2", tiny_tokenizer("chatml"))
    assert body_kernels(model, _args("auto", "cpu")) == "off"
    assert "forward" not in vars(model.model.norm)  # untouched: Liger patches the instances' forward


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_auto_turns_them_on_with_either_backend_for_training_only(backend, restore_qwen2):
    """The HF fast decode samples with the same model: it keeps HF's modules (tests/model/test_liger.py)."""
    pytest.importorskip("liger_kernel")
    model = tiny_model("qwen2", tiny_tokenizer("chatml"))
    assert body_kernels(model, _args("auto", "cuda", backend=backend)) == "on"
    assert "_liger_forward" in vars(model.model.norm) and "_plain_forward" in vars(model.model.layers[0].mlp)


def test_on_needs_cuda_and_says_so():
    args = parse_args(["--liger", "on", "--device", "cpu"])
    with pytest.raises(UsageError, match="--liger on: Liger's kernels run on CUDA only"):
        resolve_device(args)


def test_covered_architecture_is_patched_and_uncovered_one_falls_back_or_fails(restore_qwen2):
    pytest.importorskip("liger_kernel")
    qwen = tiny_model("qwen2", tiny_tokenizer("chatml"))
    assert body_kernels(qwen, _args("auto", "cuda")) == "on"  # patching needs no GPU; running it does
    assert "forward" in vars(qwen.model.norm) and "forward" in vars(qwen.model.layers[0].mlp)
    gpt2 = tiny_model("gpt2", tiny_tokenizer("chatml"))
    assert body_kernels(gpt2, _args("auto", "cuda")) == "off"
    with pytest.raises(UsageError, match="--liger on: Liger-Kernel has no kernels for model_type 'gpt2'"):
        body_kernels(gpt2, _args("on", "cuda"))
    assert body_kernels(gpt2, _args("off", "cuda")) == "off"
