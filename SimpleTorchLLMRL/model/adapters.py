"""Several policies on one base model: one named LoRA adapter per agent (plain `peft`, no wrapper class).

    model = add_agent_adapters(base, ["proposer", "solver"], r=8)   # PeftModel, every adapter starts as the base
    with use_adapter(model, "solver"):                             # forward / generate / loss with that adapter only
        loss = grpo.calculate_loss(views, rewards)
    opt = torch.optim.AdamW(adapter_parameters(model, "solver"), lr=1e-3)   # that adapter's tensors, nothing else
    with use_adapter(model, None):                                 # the base (every adapter off): the KL reference
        ...
    save_adapters(model, "ckpt"); model = load_adapters(base_again, "ckpt")

docs/multi_policy.md says more.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from SimpleTorchLLMRL.model.lora import is_peft_model, is_quantized, keep_cpu_4bit_differentiable, lora_config

_AGENTS_FILE = "agents.json"


def _check_names(names: Sequence[str]) -> list[str]:
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ValueError("give at least one adapter name")
    for n in names:
        if not isinstance(n, str) or not n or "." in n or "/" in n:
            raise ValueError(f"an adapter name must be a non-empty str without '.' or '/', got {n!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"adapter names must be distinct, got {names}")
    return names


def adapter_names(model: nn.Module) -> list[str]:
    """The LoRA adapters a peft model holds, in the order they were added ([] for a plain model)."""
    return list(model.peft_config) if is_peft_model(model) else []


def add_agent_adapters(model: nn.Module, agents: Sequence[str], r: int = 16, alpha: float = 32,
                       target_modules: str | list[str] = "all-linear", dropout: float = 0.0, **kwargs: Any):
    """One LoRA adapter per agent name on `model` (a plain causal LM, or a PeftModel to extend); returns the
    PeftModel, every new adapter trainable and starting as the base (B = 0), the base frozen, the first
    adapter active. Extra kwargs go to `peft.LoraConfig`."""
    from peft import get_peft_model

    names = _check_names(agents)
    taken = set(adapter_names(model))
    clash = sorted(taken & set(names))
    if clash:
        raise ValueError(f"the model already has adapters {clash}")
    if "fan_in_fan_out" not in kwargs and any(type(m).__name__ == "Conv1D" for m in model.modules()):
        kwargs["fan_in_fan_out"] = True  # GPT-2 style Conv1D stores weights as (in, out)
    config = lambda: lora_config(r, alpha, target_modules, dropout, **kwargs)  # noqa: E731 (one object per adapter)
    if not is_peft_model(model):
        model = get_peft_model(model, config(), adapter_name=names[0])
        names_to_add = names[1:]
    else:
        names_to_add = names
    flags = _requires_grad(model)
    for n in names_to_add:
        model.add_adapter(n, config())
    for p_name, p in model.named_parameters():  # peft leaves added adapters frozen: make all ours trainable
        p.requires_grad_(flags.get(p_name, False) or _adapter_of(p_name) in names)
    return model


def _adapter_of(param_name: str) -> str | None:
    """"...q_proj.lora_A.solver.weight" -> "solver"; None for a non-LoRA tensor."""
    parts = param_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_") and i + 1 < len(parts):
            return parts[i + 1]
    return None


def _requires_grad(model: nn.Module) -> dict[str, bool]:
    return {n: p.requires_grad for n, p in model.named_parameters()}


def _restore_requires_grad(model: nn.Module, flags: dict[str, bool]) -> None:
    for n, p in model.named_parameters():
        if n in flags and p.requires_grad != flags[n]:
            p.requires_grad_(flags[n])


def _check_adapter(model: nn.Module, name: str) -> None:
    if not is_peft_model(model):
        raise ValueError(f"adapter {name!r} asked of a model without adapters ({type(model).__name__}); "
                         "see add_agent_adapters")
    if name not in model.peft_config:
        raise ValueError(f"no adapter {name!r}; the model has {adapter_names(model)}")


def adapter_parameters(model: nn.Module, name: str) -> list[nn.Parameter]:
    """The LoRA tensors of adapter `name` (every one, trainable or not): what its optimizer steps."""
    _check_adapter(model, name)
    return [p for n, p in model.named_parameters() if _adapter_of(n) == name]


def adapter_state_dict(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """{parameter name: detached tensor} of adapter `name` (full peft names)."""
    _check_adapter(model, name)
    return {n: p.detach() for n, p in model.named_parameters() if _adapter_of(n) == name}


def freeze_adapter(model: nn.Module, name: str, frozen: bool = True) -> None:
    """Fix adapter `name` (requires_grad False; `frozen=False` undoes it): a frozen agent keeps its policy."""
    for p in adapter_parameters(model, name):
        p.requires_grad_(not frozen)


@contextlib.contextmanager
def use_adapter(model: nn.Module, name: str | None) -> Iterator[nn.Module]:
    """Inside: `model` computes with adapter `name` alone; `None`: the base model (every adapter off). On exit
    the previous adapter is active again; every `requires_grad` is left as it was (unlike peft's `set_adapter`)."""
    if name is None:
        if not is_peft_model(model):
            yield model
            return
        flags = _requires_grad(model)
        try:
            with model.disable_adapter():  # peft freezes every adapter inside and re-sets them on exit
                _restore_requires_grad(model, flags)
                yield model
        finally:
            _restore_requires_grad(model, flags)
        return
    _check_adapter(model, name)
    previous, flags = model.active_adapter, _requires_grad(model)
    try:
        if previous != name:
            model.set_adapter(name)
            _restore_requires_grad(model, flags)
        yield model
    finally:
        if model.active_adapter != previous:
            model.set_adapter(previous)
        _restore_requires_grad(model, flags)


def save_adapters(model: nn.Module, path: str | os.PathLike, names: Sequence[str] | None = None) -> dict[str, str]:
    """Write each adapter (names: default every one) to `path/<name>/`, what vLLM's LoRARequest reads; returns
    {name: directory}. `path/agents.json` lists them in order."""
    from SimpleTorchLLMRL.model.generation.weight_sync import export_adapter

    names = _check_names(adapter_names(model) if names is None else names)
    for n in names:
        _check_adapter(model, n)
    os.makedirs(path, exist_ok=True)
    out = {}
    for n in names:
        d = os.path.join(os.fspath(path), n)
        os.makedirs(d, exist_ok=True)
        # peft writes a non-default adapter into a sub-folder named after it; `export_adapter` returns that folder
        written = export_adapter(model, d, adapter_name=n)
        if os.path.normpath(written) != os.path.normpath(d):
            for f in os.listdir(written):
                os.replace(os.path.join(written, f), os.path.join(d, f))
            os.rmdir(written)
        out[n] = d
    with open(os.path.join(os.fspath(path), _AGENTS_FILE), "w", encoding="utf-8") as f:
        json.dump({"adapters": names, "trainable": {n: any(p.requires_grad for p in adapter_parameters(model, n))
                                                    for n in names}}, f, indent=1)
    return out


def load_adapters(base: nn.Module, path: str | os.PathLike, names: Sequence[str] | None = None, *,
                  is_trainable: bool = True):
    """The PeftModel of `save_adapters`: `base` (a plain model, or a PeftModel to add to) plus each `path/<name>/`
    (names: default those in `path/agents.json`), the first active. With `is_trainable`, adapters saved
    trainable are trainable again and frozen ones stay frozen; otherwise all are frozen."""
    from peft import PeftModel

    with open(os.path.join(os.fspath(path), _AGENTS_FILE), encoding="utf-8") as f:
        index = json.load(f)
    names = _check_names(index["adapters"] if names is None else names)
    missing = [n for n in names if not os.path.isdir(os.path.join(os.fspath(path), n))]
    if missing:
        raise ValueError(f"{path}: no saved adapter {missing}; saved: {index['adapters']}")
    model = base
    for n in names:
        d = os.path.join(os.fspath(path), n)
        if is_peft_model(model):
            model.load_adapter(d, adapter_name=n, is_trainable=is_trainable)
        else:
            keep_cpu_4bit_differentiable(model)
            model = PeftModel.from_pretrained(model, d, adapter_name=n, is_trainable=is_trainable)
    for n in names:
        freeze_adapter(model, n, frozen=not (is_trainable and index.get("trainable", {}).get(n, True)))
    return model


def merged_adapter_model(model: nn.Module, name: str) -> nn.Module:
    """A plain transformers copy of the base with only adapter `name` folded in (`model` is untouched)."""
    _check_adapter(model, name)
    if is_quantized(model):
        raise ValueError("merged_adapter_model refuses a 4-bit (QLoRA) base: merging into NF4 weights is lossy")
    target = copy.deepcopy(model)
    target.set_adapter(name)
    for other in adapter_names(target):
        if other != name:
            target.delete_adapter(other)
    return target.merge_and_unload(adapter_names=[name])
