"""DeepSpeed ZeRO-2 / ZeRO-3 behind the optional `deepspeed` extra (`uv sync --extra deepspeed`).

    cfg = ZeroConfig(stage=2, micro_batch_size=4, bf16=True)
    engine, optimizer = wrap_deepspeed(model, torch.optim.AdamW(params, lr=1e-6), cfg)
    loss = GRPO(engine.module, tokenizer).calculate_loss(rollouts, rewards, normalizer=data_parallel_normalizer(n))
    engine.backward(loss); engine.step()          # DeepSpeed owns backward / step / zero_grad
    sd = deepspeed_full_state_dict(engine)        # rank 0: full CPU tensors (ZeRO-3 gathers)

ZeRO-3 releases the output head after the forward, which the chunked log-probs apply afterwards: use
ZeRO-2 or FSDP2 for the GRPO / PPO losses (docs/scale.md). deepspeed is imported only when used.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

INSTALL_HINT = "DeepSpeed support needs the optional deepspeed extra: run `uv sync --extra deepspeed`"


def import_deepspeed():
    """The deepspeed module, or an ImportError that says how to install it."""
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return deepspeed


def deepspeed_available() -> bool:
    try:
        import_deepspeed()
    except ImportError:
        return False
    return True


@dataclass
class ZeroConfig:
    """The few DeepSpeed settings an RL loop needs; `to_dict()` is a plain DeepSpeed JSON config.

    stage: 2 (shard optimizer state + gradients) or 3 (also parameters).
    micro_batch_size / grad_accum: per-rank sequences per backward / backwards per step.
    bf16 / fp16: mixed precision (at most one). offload_optimizer / offload_params: to CPU
    (offload_params needs stage 3). gradient_clipping: max grad norm, None for no clipping.
    extra: merged last into the dict, for anything else DeepSpeed accepts.
    """

    stage: int = 2
    micro_batch_size: int = 1
    grad_accum: int = 1
    bf16: bool = False
    fp16: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    gradient_clipping: float | None = 1.0
    extra: dict | None = None

    def __post_init__(self):
        if self.stage not in (2, 3):
            raise ValueError(f"ZeroConfig stage must be 2 or 3, got {self.stage!r}")
        for name in ("micro_batch_size", "grad_accum"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ZeroConfig {name} must be an int >= 1, got {value!r}")
        if self.bf16 and self.fp16:
            raise ValueError("ZeroConfig bf16 and fp16 are exclusive; set at most one")
        if self.offload_params and self.stage != 3:
            raise ValueError("ZeroConfig offload_params=True needs stage=3 (ZeRO-2 keeps parameters on device)")
        if self.gradient_clipping is not None and self.gradient_clipping <= 0:
            raise ValueError(f"ZeroConfig gradient_clipping must be > 0 or None, got {self.gradient_clipping!r}")

    def to_dict(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.stage, "overlap_comm": True, "contiguous_gradients": True}
        if self.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if self.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        if self.stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.grad_accum,
            "zero_optimization": zero,
            "bf16": {"enabled": self.bf16},
            "fp16": {"enabled": self.fp16},
            "zero_allow_untested_optimizer": True,  # the user owns the optimizer (any torch.optim class)
        }
        if self.gradient_clipping is not None:
            cfg["gradient_clipping"] = float(self.gradient_clipping)
        for key, value in (self.extra or {}).items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key] = {**cfg[key], **value}
            else:
                cfg[key] = value
        return cfg


def wrap_deepspeed(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   config: ZeroConfig | dict | None = None):
    """`deepspeed.initialize` on `model` with your optimizer; returns (engine, optimizer).

    config: a ZeroConfig, a DeepSpeed config dict, or None (ZeroConfig()). Without
    an optimizer DeepSpeed builds one from the config's "optimizer" section.
    """
    ds = import_deepspeed()
    cfg = config if config is not None else ZeroConfig()
    cfg = cfg.to_dict() if isinstance(cfg, ZeroConfig) else dict(cfg)
    if optimizer is None and "optimizer" not in cfg:
        raise ValueError("wrap_deepspeed needs an optimizer, or an 'optimizer' section in the DeepSpeed config")
    params = None if optimizer is not None else [p for p in model.parameters() if p.requires_grad]
    engine, opt, _, _ = ds.initialize(model=model, optimizer=optimizer, model_parameters=params, config=cfg)
    return engine, opt


def deepspeed_full_state_dict(engine, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Full CPU tensors of `engine.module` (ZeRO-3 parameters are gathered); {} on other ranks if rank0_only.

    A collective under ZeRO-3: every rank must call it.
    """
    ds = import_deepspeed()
    module = engine.module
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
    gathered = (ds.zero.GatheredParameters(list(module.parameters()), modifier_rank=None) if stage == 3
                else contextlib.nullcontext())  # a collective: every rank enters it
    with gathered:
        if rank0_only and rank != 0:
            return {}
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
