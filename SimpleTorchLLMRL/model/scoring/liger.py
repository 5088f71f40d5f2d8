"""Liger-Kernel's fused Triton kernels in the model body: RMSNorm, SwiGLU MLP, rotary embeddings.

    from SimpleTorchLLMRL.model.scoring.liger import apply_liger_kernels
    model = apply_liger_kernels(model)  # before training; CUDA only

The body is where most of a step's time goes once the head is chunked (`model.scoring.logprobs`); the
HF body runs each RMSNorm, SwiGLU and RoPE as several elementwise kernels. Liger-Kernel
(`pip install 'SimpleTorchLLMRL[liger]'`) fuses each into one, as `TRL(use_liger_kernel=True)`
does. Only the body is patched: the output head and the loss stay ours, so every trainer,
`head_impl` and the float64-checked log-prob path are unchanged.

Liger patches the model's modules in place and, for RoPE, the function in the model's
`transformers` module (every model of that architecture in the process).
"""

from __future__ import annotations

from SimpleTorchLLMRL.model.scoring.head import unwrap


def _base_model(model):
    """peft / DDP / compile wrappers -> the transformers model that Liger knows by `config.model_type`."""
    model = unwrap(model)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def apply_liger_kernels(model, *, rope: bool = True, rms_norm: bool = True, swiglu: bool = True):
    """Swap the body's RMSNorm / SwiGLU / RoPE for Liger-Kernel's fused ones; returns the model.

    Raises ImportError without liger-kernel, ValueError for an architecture Liger does not cover.
    """
    try:
        from liger_kernel.transformers import monkey_patch
    except ImportError as e:
        raise ImportError("apply_liger_kernels needs liger-kernel: pip install 'SimpleTorchLLMRL[liger]'") from e
    base = _base_model(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    supported = monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN
    if model_type not in supported:
        raise ValueError(f"Liger-Kernel has no kernels for model_type {model_type!r}; it covers: "
                         f"{', '.join(sorted(supported))}")
    # the head and the loss stay ours: no fused linear cross-entropy, no cross-entropy patch
    monkey_patch._apply_liger_kernel_to_instance(model=base, rope=rope, rms_norm=rms_norm, swiglu=swiglu,
                                                 cross_entropy=False, fused_linear_cross_entropy=False)
    return model
