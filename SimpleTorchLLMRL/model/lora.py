"""LoRA and QLoRA over plain `peft` + `bitsandbytes` objects; every function takes and returns plain modules.

    model = apply_lora(model, r=16, alpha=32)             # PeftModel, only adapters train
    model = load_qlora("Qwen/Qwen2.5-0.5B", r=16)          # 4-bit nf4 base + LoRA
    with adapter_disabled(model):                          # the frozen base = GRPO/PPO reference
        ref_logits = model(input_ids).logits
    save_adapter(model, "ckpt/adapter"); model = load_adapter(base, "ckpt/adapter")
    export = merge_for_export(model)                       # plain transformers model, LoRA folded in
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn


def is_peft_model(model: nn.Module) -> bool:
    """True for a `peft.PeftModel`, also wrapped (FSDP2 keeps the class; DeepSpeed forwards attributes): told
    by `peft_config` and `disable_adapter()`, what the library uses, with no peft import."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def is_quantized(model: nn.Module) -> bool:
    """True when the (base) model holds bitsandbytes 4-bit or 8-bit weights."""
    base = model.get_base_model() if is_peft_model(model) else model
    if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False):
        return True
    return any(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in base.modules())


def _check_lora_args(r: int, alpha: float, dropout: float, target_modules: Any) -> None:
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"r must be a positive int (the LoRA rank), got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ValueError(f"alpha must be a positive number (scaling = alpha / r), got {alpha!r}")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")
    if not (isinstance(target_modules, str) or
            (isinstance(target_modules, (list, tuple)) and target_modules
             and all(isinstance(t, str) for t in target_modules))):
        raise ValueError(f"target_modules must be 'all-linear', a regex string, or a non-empty list of module "
                         f"names, got {target_modules!r}")


def lora_config(r: int = 16, alpha: float = 32, target_modules: str | list[str] = "all-linear",
                dropout: float = 0.0, **kwargs: Any):
    """A `peft.LoraConfig` for a causal LM; extra kwargs go to `LoraConfig` unchanged."""
    from peft import LoraConfig

    _check_lora_args(r, alpha, dropout, target_modules)
    target = list(target_modules) if isinstance(target_modules, tuple) else target_modules
    kwargs.setdefault("task_type", "CAUSAL_LM")
    return LoraConfig(r=r, lora_alpha=alpha, target_modules=target, lora_dropout=float(dropout), **kwargs)


def apply_lora(model: nn.Module, r: int = 16, alpha: float = 32, target_modules: str | list[str] = "all-linear",
               dropout: float = 0.0, *, adapter_dtype: torch.dtype | str = "base", **kwargs: Any):
    """Wrap `model` in a `PeftModel` with LoRA adapters; only adapter weights require grad.

    target_modules="all-linear" adapts every linear layer except the output head. Extra kwargs (e.g.
    `init_lora_weights=False`, `use_rslora=True`, `modules_to_save=[...]`) are passed to `peft.LoraConfig`.
    adapter_dtype: "base" (default), the base model's floating dtype (a 4-bit base: its compute dtype), or
    torch.float32 / "float32", peft's own default, at a memory cost (docs/scale.md, "Adapter dtype").
    """
    from peft import get_peft_model

    if is_peft_model(model):
        raise ValueError("apply_lora got a model that is already a PeftModel; add adapters with model.add_adapter")
    dtype = adapter_dtype_for(model, adapter_dtype)
    if "fan_in_fan_out" not in kwargs and any(type(m).__name__ == "Conv1D" for m in model.modules()):
        kwargs["fan_in_fan_out"] = True  # GPT-2 style Conv1D stores weights as (in, out)
    peft_model = get_peft_model(model, lora_config(r, alpha, target_modules, dropout, **kwargs),
                                autocast_adapter_dtype=False)
    for param in peft_model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return peft_model


def adapter_dtype_for(model: nn.Module, adapter_dtype: torch.dtype | str = "base") -> torch.dtype:
    """The dtype LoRA adapters get: "base" = the model's floating weights' dtype (4-bit: compute dtype)."""
    if adapter_dtype != "base":
        return _resolve_dtype(adapter_dtype, "adapter_dtype")
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    compute = quant.get("bnb_4bit_compute_dtype") if isinstance(quant, dict) else getattr(
        quant, "bnb_4bit_compute_dtype", None)
    if compute is not None and is_quantized(model):
        return _resolve_dtype(str(compute).removeprefix("torch."), "bnb_4bit_compute_dtype")
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return max(set(floating), key=floating.count) if floating else torch.float32


def bnb_4bit_config(compute_dtype: torch.dtype | str | None = None):
    """4-bit NF4 with double quantization (the QLoRA recipe) as a `BitsAndBytesConfig`; compute_dtype: the
    matmul dtype (None: bfloat16 on CUDA, float32 on CPU)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=_resolve_dtype(compute_dtype, "compute_dtype"))


def _resolve_dtype(dtype: torch.dtype | str | None, name: str) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} must be torch.float32, torch.bfloat16, torch.float16 (or their names), got {dtype!r}")
    return dtype


def keep_cpu_4bit_differentiable(model: nn.Module) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference, which would leave a kernel with no
    input backward (docs/scale.md, "CPU note"); returns the layers changed."""
    changed = 0
    for m in model.modules():
        if getattr(m, "support_avx512bf16_for_cpu", False):
            m.support_avx512bf16_for_cpu = False
            changed += 1
    return changed


def load_qlora(path_or_id: str, r: int = 16, alpha: float = 32, target_modules: str | list[str] = "all-linear",
               dropout: float = 0.0, *, compute_dtype: torch.dtype | str | None = None,
               gradient_checkpointing: bool = False, model_kwargs: dict[str, Any] | None = None,
               **lora_kwargs: Any):
    """QLoRA: load `path_or_id` in 4-bit NF4 (double quantization), prepare it for k-bit training, add LoRA,
    its adapters in the compute dtype (adapter_dtype=torch.float32 in lora_kwargs for float32 ones); the base
    cannot be merged losslessly (sync vLLM through the adapter). `model_kwargs` go to `from_pretrained`."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    _check_lora_args(r, alpha, dropout, target_modules)
    dtype = _resolve_dtype(compute_dtype, "compute_dtype")
    kwargs = dict(model_kwargs or {})
    if "quantization_config" in kwargs or "load_in_4bit" in kwargs:
        raise ValueError("load_qlora sets quantization_config itself; do not pass it (or load_in_4bit) in model_kwargs")
    kwargs.setdefault("dtype", dtype)
    model = AutoModelForCausalLM.from_pretrained(path_or_id, quantization_config=bnb_4bit_config(dtype), **kwargs)
    keep_cpu_4bit_differentiable(model)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    lora_kwargs.setdefault("adapter_dtype", dtype)
    return apply_lora(model, r, alpha, target_modules, dropout, **lora_kwargs)


def adapter_disabled(model: nn.Module):
    """Context manager: inside it a peft model computes with its base weights only (the KL reference, no
    second copy); a no-op for a model without adapters."""
    if is_peft_model(model):
        return model.disable_adapter()
    return contextlib.nullcontext()


def trainable_parameter_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def save_adapter(model: nn.Module, path: str, *, is_main_process: bool = True) -> str:
    """Write the adapter weights and `adapter_config.json` to `path` (what vLLM's LoRARequest reads)."""
    if not is_peft_model(model):
        raise ValueError("save_adapter needs a PeftModel (see apply_lora / load_qlora)")
    model.save_pretrained(path, is_main_process=is_main_process)
    return path


def load_adapter(base: nn.Module | str, path: str, *, is_trainable: bool = True, adapter_name: str = "default",
                 **model_kwargs: Any):
    """A `PeftModel` from a base model (module, or a path loaded with `from_pretrained`) and a saved adapter;
    for a QLoRA adapter, the base loaded with `quantization_config=bnb_4bit_config()`."""
    from peft import PeftModel

    if isinstance(base, str):
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(base, **model_kwargs)
    if is_peft_model(base):
        raise ValueError("load_adapter needs the base model without adapters; got a PeftModel")
    keep_cpu_4bit_differentiable(base)
    return PeftModel.from_pretrained(base, path, adapter_name=adapter_name, is_trainable=is_trainable)


def merge_for_export(model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """A plain transformers model with the LoRA deltas folded into the base weights, by default of a deep
    copy (training can continue on `model`). A 4-bit base is refused (merging into NF4 is lossy)."""
    if not is_peft_model(model):
        raise ValueError("merge_for_export needs a PeftModel; a plain model needs no merging")
    if is_quantized(model):
        raise ValueError("merge_for_export refuses a 4-bit (QLoRA) base: merging into NF4 weights is lossy. Load "
                         "the base in bf16/fp32, load_adapter(base, adapter_dir), then merge_for_export that model.")
    target = model if inplace else copy.deepcopy(model)
    return target.merge_and_unload()
