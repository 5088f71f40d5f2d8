"""Weights for an inference engine (vLLM) from a training model: plain state dicts, no vllm import.

    weights = vllm_weights(model)              # {HF base name: tensor}; LoRA merged in, peft names gone
    path = export_adapter(model, "/tmp/adapter_step_7")   # adapter_config.json + adapter_model.safetensors

Under FSDP2 both are collectives (rank 0 gets the data); a 4-bit base is refused by `vllm_weights`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
from torch import nn

PEFT_PREFIX = "base_model.model."
_QUANT_STATE_MARKERS = (".absmax", ".quant_map", ".quant_state.", ".nested_absmax", ".nested_quant_map", ".SCB")


@dataclass(frozen=True)
class LoraSpec:
    """How one adapted module merges: W += scaling * (B @ A), transposed when fan_in_fan_out / embedding."""

    scaling: float
    transpose: bool = False


def strip_peft_name(name: str) -> str:
    """`base_model.model.model.layers.0.q_proj.base_layer.weight` -> `model.layers.0.q_proj.weight`."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    return name.replace(".base_layer.", ".")


def _adapter_part(name: str) -> tuple[str, str, str] | None:
    """(module, kind, adapter) for a LoRA tensor name, e.g. ("model.layers.0.q_proj", "lora_A", "default")."""
    m = re.match(r"^(.*)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.([^.]+)"
                 r"(?:\.weight)?$", name)
    return (m.group(1), m.group(2), m.group(3)) if m else None


def is_quantized_state_dict(state_dict: dict[str, torch.Tensor]) -> bool:
    return any(any(mark in k for mark in _QUANT_STATE_MARKERS) for k in state_dict)


def base_weights(state_dict: dict[str, torch.Tensor], adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The base model's tensors under its HF names: LoRA tensors dropped, `modules_to_save[adapter]` kept (a
    plain state dict comes back unchanged)."""
    saved = f".modules_to_save.{adapter_name}."
    out: dict[str, torch.Tensor] = {}
    overrides: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if _adapter_part(name) is not None:
            continue
        if ".modules_to_save." in name:
            if saved in name:
                overrides[strip_peft_name(name.replace(saved, "."))] = tensor
            continue
        out[strip_peft_name(name.replace(".original_module.", "."))] = tensor
    out.update(overrides)
    return out


def lora_specs(model: nn.Module, adapter_name: str = "default") -> dict[str, LoraSpec]:
    """{HF module name: LoraSpec} for every module carrying adapter `adapter_name` (works under FSDP2)."""
    from peft.tuners.lora import LoraLayer

    specs = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter_name not in module.scaling:
            continue
        if getattr(module, "use_dora", {}).get(adapter_name, False):
            raise NotImplementedError(f"merging DoRA adapters is not supported (module {name})")
        is_embedding = adapter_name in getattr(module, "lora_embedding_A", {})
        transpose = is_embedding or bool(getattr(module, "fan_in_fan_out", False))
        specs[strip_peft_name(name + ".")[:-1]] = LoraSpec(float(module.scaling[adapter_name]), transpose)
    return specs


def merge_lora_weights(state_dict: dict[str, torch.Tensor], specs: dict[str, LoraSpec],
                       adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """Base weights (HF names) with every adapter delta of `adapter_name` folded in, in float32 and cast back to
    the base dtype; the input is not modified. Each adapted module needs both halves and a `specs` entry."""
    if is_quantized_state_dict(state_dict):
        raise ValueError("this state dict holds 4-bit/8-bit (bitsandbytes) weights, which cannot be merged exactly; "
                         "push the adapter instead (export_adapter + LoRARequest)")
    out = base_weights(state_dict, adapter_name)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        part = _adapter_part(name)
        if part is None or part[2] != adapter_name:
            continue
        module, kind, _ = part
        if kind == "lora_magnitude_vector":
            raise NotImplementedError(f"merging DoRA adapters is not supported ({name})")
        halves.setdefault(strip_peft_name(module + ".")[:-1], {})[kind.replace("embedding_", "")] = tensor
    for module, ab in halves.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"module {module} has {sorted(ab)} but needs both lora_A and lora_B to merge")
        if module not in specs:
            raise ValueError(f"no LoraSpec (scaling) for adapted module {module}; build specs with lora_specs(model)")
        key = module + ".weight"
        if key not in out:
            raise ValueError(f"adapted module {module} has no base weight {key} in the state dict")
        spec, base = specs[module], out[key]
        delta = ab["lora_B"].float() @ ab["lora_A"].float()  # (out, in), or (dim, vocab) for an embedding
        if spec.transpose:
            delta = delta.T
        out[key] = (base.float() + spec.scaling * delta.to(base.device)).to(base.dtype)
    return out


def gathered_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors: FSDP2 gathers to rank 0 on CPU (others get {}); a plain model's own tensors stay on its device."""
    from SimpleTorchLLMRL.distributed.fsdp import full_state_dict, is_fsdp2

    if is_fsdp2(model):
        return full_state_dict(model, cpu_offload=True)
    return {k: v.detach() for k, v in model.state_dict().items()}


def vllm_weights(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None, *,
                 adapter_name: str = "default", merge_lora: bool = True) -> dict[str, torch.Tensor]:
    """Full weights under the base model's HF names, ready for vLLM `load_weights(weights.items())`. `model`:
    transformers or peft, plain or FSDP2 (`state_dict` defaults to `gathered_state_dict(model)`, a collective:
    ranks other than 0 get {}). LoRA deltas merged (merge_lora=True) or dropped; a 4-bit base is refused."""
    from SimpleTorchLLMRL.model.lora import is_peft_model, is_quantized

    if is_quantized(model):
        raise ValueError("vllm_weights cannot export a 4-bit (QLoRA) base exactly; sync the adapter instead: "
                         "export_adapter(model, path) and generate with a vllm LoRARequest")
    if state_dict is None:
        state_dict = gathered_state_dict(model)
    if not state_dict:
        return {}
    if not is_peft_model(model):
        return dict(state_dict)
    if not merge_lora:
        return base_weights(state_dict, adapter_name)
    return merge_lora_weights(state_dict, lora_specs(model, adapter_name), adapter_name)


def adapter_weights(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None, *,
                    adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter tensors under the names peft saves (`...q_proj.lora_A.weight`), as vLLM's LoRA loader reads them."""
    from peft import get_peft_model_state_dict

    if state_dict is None:
        state_dict = gathered_state_dict(model)
    if not state_dict:
        return {}
    return get_peft_model_state_dict(model, state_dict=state_dict, adapter_name=adapter_name)


def export_adapter(model: nn.Module, path: str, *, adapter_name: str = "default",
                   state_dict: dict[str, torch.Tensor] | None = None) -> str:
    """Write adapter_config.json + adapter_model.safetensors for `LoRARequest(name, id, path)`; returns the
    folder. On FSDP2-sharded peft models a collective: every rank calls it, rank 0 writes."""
    from SimpleTorchLLMRL.distributed.launch import get_rank
    from SimpleTorchLLMRL.model.lora import is_peft_model

    if not is_peft_model(model):
        raise ValueError("export_adapter needs a PeftModel; push full weights with vllm_weights instead")
    if state_dict is None:
        state_dict = gathered_state_dict(model)
    if get_rank() == 0:
        model.save_pretrained(path, selected_adapters=[adapter_name], state_dict=state_dict,
                              is_main_process=True)
    # peft writes a non-default adapter into a sub-folder named after it
    return path if adapter_name == "default" else os.path.join(path, adapter_name)
