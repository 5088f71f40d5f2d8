"""Liger-Kernel's fused Triton kernels in the model body, for training only: RMSNorm, SwiGLU MLP, rotary embeddings.

    from SimpleTorchLLMRL.model.scoring.liger import apply_liger_kernels
    model = apply_liger_kernels(model)  # before training; CUDA only

The body is where most of a step's time goes once the head is chunked (`model.scoring.logprobs`); the
HF body runs each RMSNorm, SwiGLU and RoPE as several elementwise kernels. Liger-Kernel
(`pip install 'SimpleTorchLLMRL[liger]'`) fuses each into one, as `TRL(use_liger_kernel=True)`
does. Only the body is patched: the output head and the loss stay ours, so every trainer,
`head_impl` and the float64-checked log-prob path are unchanged.

For training only: Liger's kernels made loss + backward faster on an H200 but the fast decode (small
batches of one token) slower. So each patched module (and the RoPE function of the model's
`transformers` module) dispatches per call: Liger's kernels in the trainer's forwards (`model.scoring`'s,
with or without grad: `head.in_scoring_forward`) and in any forward with grad enabled (so a
gradient-checkpointed layer recomputes with them in backward), HF's own modules elsewhere, i.e. in
the decode, which runs without grad. The choice is a Python branch that `torch.compile` guards on.
"""

from __future__ import annotations

import sys
import types

import torch

from SimpleTorchLLMRL.model.scoring.head import in_scoring_forward, unwrap

_HIDDEN = ("_get_name", "extra_repr")  # names Liger gives its modules: the HF ones are kept


def _base_model(model):
    """peft / DDP / compile wrappers -> the transformers model that Liger knows by `config.model_type`."""
    model = unwrap(model)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def training() -> bool:
    """Whether the forward running now is the trainer's: a scoring forward, or any forward with grad enabled."""
    return in_scoring_forward() or torch.is_grad_enabled()


def _dispatching_forward(self, *args, **kwargs):
    """A patched module's forward: Liger's in training, the module's own elsewhere (the decode)."""
    return (self._liger_forward if training() else self._plain_forward)(*args, **kwargs)


def _dispatching_function(liger, plain):
    """A module-level function (RoPE) that calls Liger's in training and HF's elsewhere."""
    if getattr(plain, "_liger_pair", None) is not None:  # another model of this architecture patched it already
        return plain

    def dispatch(*args, **kwargs):
        return (liger if training() else plain)(*args, **kwargs)

    dispatch._liger_pair = (liger, plain)
    return dispatch


def _training_only(base, module, globals_before: dict, modules_before: dict) -> None:
    """Turn what Liger changed (the modeling module's names, the instances' methods) into per-call dispatches."""
    for name, value in list(vars(module).items()):
        old = globals_before.get(name)
        if old is None or value is old:
            continue
        # classes matter only when a model is built (keep HF's); functions are called per forward: dispatch
        setattr(module, name, old if isinstance(value, type) else _dispatching_function(value, old))
    for m in base.modules():
        before, now = modules_before[m], vars(m)
        for name in _HIDDEN:
            if name in now and now[name] is not before.get(name):
                if name in before:
                    now[name] = before[name]
                else:
                    del now[name]
        liger = now.get("forward")
        if liger is None or liger is before.get("forward"):
            continue
        m._liger_forward = liger  # bound methods: a deepcopy of the model rebinds them to the copy
        m._plain_forward = before.get("forward", types.MethodType(type(m).forward, m))
        now["forward"] = types.MethodType(_dispatching_forward, m)


def apply_liger_kernels(model, *, rope: bool = True, rms_norm: bool = True, swiglu: bool = True):
    """Liger-Kernel's RMSNorm / SwiGLU / RoPE in the body's training forwards; returns the model (module docstring).

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
    if any("_liger_forward" in vars(m) for m in base.modules()):
        return model  # patched already
    module = sys.modules[type(base).__module__]
    globals_before, modules_before = dict(vars(module)), {m: dict(vars(m)) for m in base.modules()}
    # the head and the loss stay ours: no fused linear cross-entropy, no cross-entropy patch
    monkey_patch._apply_liger_kernel_to_instance(model=base, rope=rope, rms_norm=rms_norm, swiglu=swiglu,
                                                 cross_entropy=False, fused_linear_cross_entropy=False)
    _training_only(base, module, globals_before, modules_before)
    return model
