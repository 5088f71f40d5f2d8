"""The steps every training loop shares: seeding, the LR schedule, and an optimizer step that refuses NaN/inf.

    seed_everything(0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_constant(10))
    grad_norm = clipped_step(optimizer, max_grad_norm=1.0)   # after backward; NonFiniteError, weights untouched
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch


class NonFiniteError(FloatingPointError):
    """A gradient norm or an updated weight is NaN or infinite: the step must not be kept."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def warmup_constant(warmup_steps: int):
    """LambdaLR factor: linear warm-up over `warmup_steps`, then constant."""
    return lambda s: min(1.0, (s + 1) / (warmup_steps + 1)) if warmup_steps else 1.0


def clipped_step(optimizer: torch.optim.Optimizer, max_grad_norm: float | None = 1.0) -> float:
    """Clip the gradients of `optimizer`'s parameters to `max_grad_norm`, step, zero the gradients.

    Returns the gradient norm before clipping. A NaN/inf gradient norm raises `NonFiniteError` before the step
    (the weights stay as they were; the gradients are zeroed). Weights that the step made NaN/inf (an infinite
    learning rate, an overflowing optimizer state) raise it too, so that a loop never checkpoints them.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if max_grad_norm is None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    norm = float(norm)
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(f"the gradient norm is {norm}: the optimizer step was skipped (check the loss, the "
                             "rewards and the learning rate)")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        weights = float(torch.nn.utils.get_total_norm([p.detach() for p in params]))
    if not math.isfinite(weights):
        raise NonFiniteError(f"the optimizer step made the weights {weights} (NaN or infinite): the learning rate "
                             f"{optimizer.param_groups[0].get('lr')} or the optimizer state is not finite")
    return norm
