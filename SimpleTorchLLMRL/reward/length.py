"""Length rewards: a linear length penalty and DAPO's soft overlong punishment.

Legend: B batch, L response length (tokens unless `unit="chars"`).

    LengthPenalty(max_length=512, min_length=128, penalty=0.5)
        0 for L <= 128, then linear down to -0.5 at L = 512, and -0.5 beyond.
    OverlongPenalty(max_length=4096, cache_length=512)          # DAPO, eq. 13
        0 for L <= 3584; (3584 - L) / 512 for 3584 < L <= 4096; -1 for L > 4096.

L is the final MODEL message's length (`scope="last"`) or the sum over all of them (`scope="all"`):
its sampled `token_ids`, else `tokenizer(content)`, else a ValueError.
"""

from __future__ import annotations

from typing import Any

import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.reward.base import Reward, check_finite

SCOPES = ("last", "all")
UNITS = ("tokens", "chars")


def overlong_penalty(lengths, max_length: int, cache_length: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13, see `OverlongPenalty`), the one implementation: lengths (B,)
    -> (B,) float32."""
    if cache_length < 0 or cache_length > max_length:
        raise ValueError(f"overlong cache_length must be in [0, max_length={max_length}], got {cache_length}")
    L = torch.as_tensor(lengths).to(torch.float32)
    start = max_length - cache_length
    ramp = (start - L) / max(cache_length, 1)
    full = torch.full_like(L, -1.0)
    return penalty * torch.where(L <= start, torch.zeros_like(L), torch.where(L <= max_length, ramp, full))


class _LengthReward(Reward):
    def __init__(self, scope: str, unit: str, tokenizer, failure_value: float):
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
        self.scope, self.unit, self.tokenizer = scope, unit, tokenizer
        self.failure_value = check_finite("failure_value", failure_value)

    def message_length(self, message: Message) -> int:
        if self.unit == "chars":
            return len(message.content)
        if message.token_ids is not None:
            return len(message.token_ids)
        if self.tokenizer is None:
            raise ValueError(
                f"{type(self).__name__}: a MODEL message has no token_ids; pass tokenizer= to count its "
                "tokens, or unit='chars'"
            )
        return len(self.tokenizer(message.content, add_special_tokens=False)["input_ids"])

    def response_length(self, rollout: Rollout, last: Message) -> int:
        if self.scope == "last":
            return self.message_length(last)
        return sum(self.message_length(m) for m in rollout if m.type is MessageType.MODEL)

    def score(self, message: Message, ground_truth: Any, rollout: Rollout) -> float:
        return self.penalty_for(self.response_length(rollout, message))

    def penalty_for(self, length: int) -> float:
        raise NotImplementedError


class LengthPenalty(_LengthReward):
    """-penalty * clip((L - min_length) / (max_length - min_length), 0, 1)."""

    name = "length"

    def __init__(self, max_length: int, min_length: int = 0, penalty: float = 1.0, scope: str = "last",
                 unit: str = "tokens", tokenizer=None, failure_value: float = 0.0):
        super().__init__(scope, unit, tokenizer, failure_value)
        if not isinstance(min_length, int) or min_length < 0:
            raise ValueError(f"min_length must be an int >= 0, got {min_length!r}")
        if not isinstance(max_length, int) or max_length <= min_length:
            raise ValueError(f"max_length must be an int > min_length={min_length}, got {max_length!r}")
        self.max_length, self.min_length = max_length, min_length
        self.penalty = check_finite("penalty", penalty)

    def penalty_for(self, length: int) -> float:
        frac = (length - self.min_length) / (self.max_length - self.min_length)
        return -self.penalty * min(1.0, max(0.0, frac))


class OverlongPenalty(_LengthReward):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by `penalty`.

    0 while L <= max_length - cache_length, then linear to -penalty at max_length,
    and -penalty beyond. cache_length=0 is a hard cut-off.
    """

    name = "overlong"

    def __init__(self, max_length: int, cache_length: int, penalty: float = 1.0, scope: str = "last",
                 unit: str = "tokens", tokenizer=None, failure_value: float = 0.0):
        super().__init__(scope, unit, tokenizer, failure_value)
        if not isinstance(max_length, int) or max_length <= 0:
            raise ValueError(f"max_length must be an int > 0, got {max_length!r}")
        if not isinstance(cache_length, int) or not 0 <= cache_length <= max_length:
            raise ValueError(f"cache_length must be an int in [0, max_length={max_length}], got {cache_length!r}")
        self.max_length, self.cache_length = max_length, cache_length
        self.penalty = check_finite("penalty", penalty)

    def penalty_for(self, length: int) -> float:
        return float(overlong_penalty([length], self.max_length, self.cache_length, self.penalty)[0])
