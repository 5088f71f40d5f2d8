"""Router-R1 reward: answer quality + format penalties - cost_coefficient x routing cost.

Legend: B batch (rollouts).

    reward = RouterReward(RouterRewardConfig(reward_metric="f1", cost_coefficient=0.5), pool)
    out = reward.compute(rollouts, golds)     # out.total (B,), out.components {name: (B,)}, out.metrics
    rewards = reward(rollouts, golds)         # the reward protocol: total only, (B,) float32

The components (`COMPONENTS`) sum to the total (docs/recipes.md, "Reward"); golds default to
`rollout.metadata["answer"]`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from SimpleTorchLLMRL.chat.message import MessageType, Rollout
from SimpleTorchLLMRL.recipes.router_r1.config import RouterRewardConfig
from SimpleTorchLLMRL.recipes.router_r1.generation import RouterState
from SimpleTorchLLMRL.recipes.router_r1.pool import RoutingPool
from SimpleTorchLLMRL.recipes.router_r1.tags import final_answer, format_problems, searches
from SimpleTorchLLMRL.reward.base import answers_of, check_batch
from SimpleTorchLLMRL.reward.text import exact_match_score, f1_score

COMPONENTS = ("answer", "missing_answer", "malformed", "unknown_model", "over_budget", "cost")
METRICS = ("em", "f1", "routing_cost", "routed_calls", "well_formed", "answered")


def golds_of(ground_truth: Any) -> list[str]:
    """A gold answer or a list of acceptable ones, as strings (a dict with "target" as in the original data);
    a missing one is a ValueError (reward.base.answers_of)."""
    if isinstance(ground_truth, dict) and "target" in ground_truth:
        ground_truth = ground_truth["target"]
    if not isinstance(ground_truth, (str, list, tuple)) and isinstance(ground_truth, Iterable) \
            and not hasattr(ground_truth, "tolist"):
        ground_truth = list(ground_truth)
    try:
        return [str(g) for g in answers_of(ground_truth)]
    except ValueError as e:
        raise ValueError(f"Router-R1 reward needs a gold answer per rollout (argument or "
                         f"metadata['answer']): {e}") from None


def answer_scores(answer: str | None, golds: Sequence[str], keep_numbers: bool = True) -> tuple[float, float]:
    """(exact match, token F1) of `answer` against the best gold; (0, 0) without an answer."""
    if answer is None:
        return 0.0, 0.0
    em = max(exact_match_score(answer, g, keep_numbers) for g in golds)
    f1 = max(f1_score(answer, g, keep_numbers) for g in golds)
    return em, f1


@dataclass
class RouterRewardOutput:
    """total (B,); components {name: (B,)} summing to total; metrics {name: (B,)} for logging."""

    total: torch.Tensor
    components: dict[str, torch.Tensor]
    metrics: dict[str, torch.Tensor]


class RouterReward:
    """The Router-R1 reward over rollouts from `RouterEnv`. pool: the `RoutingPool` (or its model names) that
    searches are checked against; without it, unknown names are read from the episode's `RouterState` only."""

    name = "router_r1"

    def __init__(self, config: RouterRewardConfig | None = None, pool: RoutingPool | Iterable[str] | None = None):
        self.config = config or RouterRewardConfig()
        if not isinstance(self.config, RouterRewardConfig):
            raise TypeError(f"config must be a RouterRewardConfig, got {type(self.config).__name__}")
        names = pool.names if isinstance(pool, RoutingPool) else pool
        self.model_names = None if names is None else {n.strip().lower() for n in names}

    def _metric(self, answer: str | None, golds: list[str]) -> float:
        if answer is None:
            return 0.0
        if self.config.reward_metric == "math":
            from SimpleTorchLLMRL.reward.math import math_equal

            return float(any(math_equal(answer, g) for g in golds))
        em, f1 = answer_scores(answer, golds, self.config.keep_numbers)
        return em if self.config.reward_metric == "em" else f1

    def _unknown_route(self, texts: list[str], state: RouterState | None) -> bool:
        if state is not None and state.has("unknown_model"):
            return True
        if self.model_names is None:
            return False
        return any(route is not None and route[0].lower() not in self.model_names
                   for text in texts for route in searches(text))

    def breakdown(self, rollout: Rollout, ground_truth: Any = None) -> tuple[dict[str, float], dict[str, float]]:
        """(components, metrics) of one rollout."""
        if not isinstance(rollout, Rollout):
            raise TypeError(f"expected a Rollout, got {type(rollout).__name__}")
        cfg = self.config
        golds = golds_of(ground_truth if ground_truth is not None else rollout.metadata.get("answer"))
        texts = [m.content for m in rollout if m.type is MessageType.MODEL]
        state = rollout.metadata.get("env_state")
        state = state if isinstance(state, RouterState) else None
        answer = final_answer(texts)
        problems = format_problems(texts, cfg.require_think)
        cost = state.cost if state is not None else 0.0
        comp = {
            "answer": cfg.correct_score * self._metric(answer, golds),
            "missing_answer": cfg.missing_answer_penalty if answer is None else 0.0,
            "malformed": cfg.malformed_penalty if problems else 0.0,
            "unknown_model": cfg.unknown_model_penalty if self._unknown_route(texts, state) else 0.0,
            "over_budget": cfg.over_budget_penalty if state is not None and state.has("over_budget") else 0.0,
            "cost": -cfg.cost_coefficient * cost,
        }
        em, f1 = answer_scores(answer, golds, cfg.keep_numbers)
        metrics = {"em": em, "f1": f1, "routing_cost": cost, "routed_calls": float(state.routed if state else 0),
                   "well_formed": float(not problems), "answered": float(answer is not None)}
        return comp, metrics

    def compute(self, rollouts: Sequence[Rollout], ground_truths: Sequence[Any] | None = None) -> RouterRewardOutput:
        gts = check_batch(rollouts, ground_truths)
        parts = [self.breakdown(r, g) for r, g in zip(rollouts, gts, strict=True)]
        comps = {k: torch.tensor([c[k] for c, _ in parts], dtype=torch.float32) for k in COMPONENTS}  # (B,) each
        mets = {k: torch.tensor([m[k] for _, m in parts], dtype=torch.float32) for k in METRICS}  # (B,) each
        total = torch.tensor([sum(c.values()) for c, _ in parts], dtype=torch.float32)  # (B,) summed in float64
        return RouterRewardOutput(total, comps, mets)

    def __call__(self, rollouts: Sequence[Rollout], ground_truths: Sequence[Any] | None = None) -> torch.Tensor:
        return self.compute(rollouts, ground_truths).total
