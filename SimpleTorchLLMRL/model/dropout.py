"""Dropout off for RL: on-policy ratios must be exactly 1 (docs/losses.md, "Dropout").

    disable_dropout(model)        # every nn.Dropout to p=0, attention dropout rates to 0
    active_dropout(model)         # names of modules that would still drop in train mode
    warn_if_dropout(name, model)  # the trainer fronts' warning, once per front
"""

from __future__ import annotations

from torch import nn

from SimpleTorchLLMRL.utils.warn import warn_user

_RATE_ATTRIBUTES = ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout",
                    "dropout_rate")


def _rates(module: nn.Module) -> dict[str, float]:
    """Float dropout rates a module reads in forward (HF attention passes `self.attention_dropout`)."""
    return {a: v for a in _RATE_ATTRIBUTES if isinstance(v := getattr(module, a, None), float)}


def active_dropout(model: nn.Module) -> list[str]:
    """Qualified names of the modules whose dropout is non-zero (empty: training is deterministic)."""
    found = []
    for name, module in model.named_modules():
        drops = isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0
        if drops or any(v > 0 for v in _rates(module).values()):
            found.append(name or type(module).__name__)
    return found


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability in `model` (peft's lora_dropout included) to 0, and the matching fields of
    `model.config` (a saved model loads without dropout); returns the model."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for attribute in _rates(module):
            setattr(module, attribute, 0.0)
    config = getattr(model, "config", None)
    for attribute in _RATE_ATTRIBUTES + ("summary_first_dropout", "classifier_dropout"):
        if isinstance(getattr(config, attribute, None), float):
            setattr(config, attribute, 0.0)
    return model


def warn_if_dropout(name: str, model) -> bool:
    """Warn when a training model has dropout on (ratios are then not 1 on-policy). Returns whether it checked."""
    if not model.training:
        return False
    active = active_dropout(model)
    if active:
        warn_user(f"{name}: the model trains with dropout on ({len(active)} modules, e.g. {active[0]}): "
                  "log-probs then come from a random sub-network, on-policy ratios are not 1 and clipping "
                  "bites where it should not. Call SimpleTorchLLMRL.model.dropout.disable_dropout(model) first.")
    return True
