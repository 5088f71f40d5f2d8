r"""reasoning-gym's procedural tasks as rows and a reward (the `reasoning-gym` extra).

    from SimpleTorchLLMRL.integrations.reasoning_gym import task

    rows, reward = task("basic_arithmetic", size=500, seed=0)
    rollouts = collect_rollouts(generator, env, [r["question"] for r in rows], [r["answer"] for r in rows])
    rewards = reward(rollouts, [r.metadata["answer"] for r in rollouts])      # (B,)

The reward extracts the answer of the final MODEL message (its `\boxed{}` by default) and asks the task's
own checker, `dataset.score_answer(answer, entry)`. That checker pays partial credit for wrong answers
(0.67 for "-28" when the answer is 28: the answer's length over the reply's when the reply contains it),
so by default the reward is strict: a score below 1 pays 0. `partial=True` pays the checker's score.
`main.py --dataset rg:NAME --reward score_answer` trains on a task with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from SimpleTorchLLMRL.chat.message import Message, Rollout
from SimpleTorchLLMRL.integrations._extras import require
from SimpleTorchLLMRL.reward.base import Reward, make_extractor
from SimpleTorchLLMRL.reward.math import extract_boxed


def task(name: str, size: int, seed: int = 0, *, partial: bool = False,
         extract: str | Callable[[str], str | None] | None = None, **config) -> tuple[list[dict], Reward]:
    """(rows {"question", "answer"}, reward) of `size` entries of reasoning-gym's task `name`.

    config: the task's own options (e.g. `min_terms=2` for basic_arithmetic). partial: pay the checker's
    partial credit. extract: how to read the answer from the reply (default its last `\\boxed{}`; a regex
    or a function, as `reward.make_extractor`). ValueError for an unknown task or a bad option.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    rg = require("reasoning_gym", "reasoning-gym")
    try:
        dataset = rg.create_dataset(name, size=size, seed=seed, **config)
    except (ValueError, TypeError, KeyError, AssertionError) as e:
        raise ValueError(f"reasoning-gym task {name!r}: {e or type(e).__name__}") from e
    entries = [dataset[i] for i in range(size)]
    rows = [{"question": str(e["question"]), "answer": str(e["answer"])} for e in entries]
    return rows, ReasoningGymReward(name, dataset, entries, partial=partial, extract=extract)


class ReasoningGymReward(Reward):
    """A reasoning-gym task's checker as a reward over its own rows (found by their question)."""

    needs_ground_truth = True

    def __init__(self, name: str, dataset, entries: list[dict], *, partial: bool = False,
                 extract: str | Callable[[str], str | None] | None = None):
        self.name = f"rg:{name}"
        self.dataset, self.partial = dataset, bool(partial)
        self.extract = extract_boxed if extract is None else make_extractor(extract)
        self.entries = {str(e["question"]): e for e in entries}

    def score(self, message: Message, ground_truth: Any, rollout: Rollout) -> float:
        question = rollout.metadata.get("question")
        entry = self.entries.get(str(question))
        if entry is None:
            raise ValueError(f"the {self.name} reward scores its own task's rows; this rollout's "
                             f"metadata['question'] is not one of them: {str(question)[:80]!r}")
        if str(entry["answer"]) != str(ground_truth):
            raise ValueError(f"the ground truth {ground_truth!r} is not the {self.name} answer of its question "
                             f"({entry['answer']!r})")
        answer = self.extract(message.content)
        answer = answer.strip() if isinstance(answer, str) else answer
        try:
            score = float(self.dataset.score_answer(answer, entry))
        except Exception:  # noqa: BLE001  (a reply that breaks the task's checker earns nothing)
            return 0.0
        if not score == score:  # NaN
            return 0.0
        return min(1.0, max(0.0, score)) if self.partial else float(score >= 1.0)
