"""`collect_rollouts`: the batched multi-turn episode loop.

Legend: Q questions, G group size, R = Q * G rollouts.

Each turn every unfinished rollout generates in one batch, then the env steps each in a thread pool.
Metadata on each rollout: "group_id" (its question's index), "question", "answer", "env_state" (the Env's
per-episode state), "tools" (a copy of `env.tools`), "turns", "done_reason" ("env", "env_error" with
metadata["env_error"], "max_turns", or "context": the next prompt would not fit), and "reward" (from
`Env.reward`) or "reward_error" (when it raised).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.env.base import Env

DEFAULT_MAX_TURNS = 10


def _check_step_result(result) -> tuple[list[Message], bool]:
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"Env.step must return (messages, done), got {type(result).__name__}")
    msgs, done = result
    msgs = list(msgs or [])
    for m in msgs:
        if not isinstance(m, Message):
            raise TypeError(f"Env.step returned a {type(m).__name__} among its messages, not a Message")
    return msgs, bool(done)


def _step(env, rollout: Rollout) -> tuple[list[Message], bool, str | None]:
    """One env step that never raises: a failure becomes a TOOL message and ends the episode."""
    try:
        msgs, done = _check_step_result(env.step(rollout, rollout.metadata.get("env_state")))
        return msgs, done, None
    except Exception as e:  # noqa: BLE001  (any env failure is data, not a crash of the batch)
        failed = f"{type(e).__name__}: {e}"
        return [Message(f"Error: the environment step failed with {failed}", MessageType.TOOL)], True, failed


def _setup(env, question, answer, group_id: int, tools) -> Rollout:
    msgs, state = env.setup(question, answer)
    meta: dict[str, Any] = {"group_id": group_id, "question": question, "answer": answer,
                            "env_state": state, "turns": 0}
    if tools is not None:
        meta["tools"] = copy.deepcopy(tools)
    return Rollout(list(msgs), meta)


def _finish(rollout: Rollout, reason: str) -> None:
    rollout.metadata["done_reason"] = reason


def _defines(env, name: str) -> bool:
    """Whether `env` has a method `name` of its own (not `Env`'s default, which does nothing)."""
    own = getattr(type(env), name, None)
    return callable(own) and own is not getattr(Env, name)


def scores_episodes(env) -> bool:
    """Whether `collect_rollouts` asks `env.reward` for each episode: the env overrides `Env.reward` and
    has no batch scorer `score(rollouts)` (CodeEnv: its caller runs the sandbox `workers` at a time)."""
    return _defines(env, "reward") and not callable(getattr(env, "score", None))


def _end_episode(env, rollout: Rollout, score: bool) -> None:
    """`env.reward` into metadata (a raise is recorded, never scored), then `env.close`; never raises."""
    state = rollout.metadata.get("env_state")
    if score:
        try:
            value = env.reward(rollout, state)
            if value is not None:
                rollout.metadata["reward"] = _as_reward(value)
        except Exception as e:  # noqa: BLE001  (a failing reward is data: the rollout carries no reward)
            rollout.metadata["reward_error"] = f"{type(e).__name__}: {e}"
    if _defines(env, "close"):
        try:
            env.close(state)
        except Exception as e:  # noqa: BLE001
            rollout.metadata.setdefault("env_error", f"close: {type(e).__name__}: {e}")


def _as_reward(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise TypeError(f"Env.reward must return a finite number or None, got {value!r}")
    return float(value)


def episode_rewards(rollouts: Sequence[Rollout]) -> torch.Tensor:
    """(B,) float32: each rollout's `metadata["reward"]` (set by `collect_rollouts` from `Env.reward`, by
    `collect_game_rollouts`, or by an integration). ValueError naming the rollouts without one, and why."""
    missing = [i for i, r in enumerate(rollouts) if "reward" not in r.metadata]
    if missing:
        first = rollouts[missing[0]].metadata
        why = first.get("reward_error") or "its env gave no reward (Env.reward returned None): use a reward function"
        raise ValueError(f"rollouts {missing[:10]} carry no metadata['reward'] (rollout {missing[0]}: {why})")
    return torch.tensor([float(r.metadata["reward"]) for r in rollouts], dtype=torch.float32)  # (B,)


def _fitting(generator, rollouts: list[Rollout], active: list[int]) -> tuple[list[int], dict]:
    """The active episodes whose next prompt fits the generator's context (the others end with done_reason
    "context"), and their prompts as encoded (`prompt_ids=`), when the generator says what fits."""
    if not hasattr(generator, "fits"):
        return active, {}
    encoded = dict(zip(active, generator.prompt_ids([rollouts[i] for i in active]), strict=True))
    for i in [i for i in active if not generator.fits(encoded[i])]:
        _finish(rollouts[i], "context")
    active = [i for i in active if generator.fits(encoded[i])]
    return active, {"prompt_ids": [encoded[i] for i in active]}


def collect_rollouts(generator, env, questions: Sequence[Any], answers: Sequence[Any] | None = None,
                     group_size: int = 1, max_turns: int | None = None,
                     max_workers: int | None = None) -> list[Rollout]:
    """Run one episode per (question, group member) and return the R = Q * G rollouts, group-major.

    generator: anything with `batch_rollout_generate_response(rollouts)`, e.g. `ModelGenerate`; with
    `prompt_ids(rollouts)` and `fits(prompt_ids)` too, an episode whose next prompt would overflow the
    context ends ("context") and the prompts go on encoded (`prompt_ids=`).
    env: an `Env`; `setup` and `step` run concurrently in threads (no unguarded shared state). A raising
    `step` ends its episode with a TOOL message; a raising `setup` propagates. Once all episodes ended,
    `env.reward` (when `scores_episodes`) goes into `metadata["reward"]`, then `env.close(state)`.
    max_turns: MODEL turns per episode (default: `env.max_turns`, else 10).
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    questions = list(questions)
    answers = [None] * len(questions) if answers is None else list(answers)
    if len(answers) != len(questions):
        raise ValueError(f"questions and answers differ in length: {len(questions)} vs {len(answers)}")
    max_turns = max_turns if max_turns is not None else (getattr(env, "max_turns", None) or DEFAULT_MAX_TURNS)
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be a positive int, got {max_turns!r}")
    if not questions:
        return []
    rows = enumerate(zip(questions, answers, strict=True))
    jobs = [(q, a, gi) for gi, (q, a) in rows for _ in range(group_size)]  # R = Q * G, group-major
    tools = getattr(env, "tools", None)
    score = scores_episodes(env)
    with ThreadPoolExecutor(max_workers=max_workers or min(32, len(jobs)), thread_name_prefix="env") as pool:
        started = [pool.submit(_setup, env, *job, tools) for job in jobs]
        failed = next((f.exception() for f in started if f.exception() is not None), None)
        if failed is not None:  # no batch to run: release the episodes that did start, then raise
            list(pool.map(lambda r: _end_episode(env, r, False), [f.result() for f in started if not f.exception()]))
            raise failed
        rollouts = [f.result() for f in started]
        try:
            _run_turns(generator, env, rollouts, max_turns, pool)
        except BaseException:
            list(pool.map(lambda r: _end_episode(env, r, False), rollouts))
            raise
        list(pool.map(lambda r: _end_episode(env, r, score), rollouts))
    return rollouts


def _run_turns(generator, env, rollouts: list[Rollout], max_turns: int, pool: ThreadPoolExecutor) -> None:
    """Up to `max_turns` batched MODEL turns, each followed by the env's concurrent steps; sets done_reason."""
    active = list(range(len(rollouts)))
    for turn in range(max_turns):
        active, prompts = _fitting(generator, rollouts, active) if turn > 0 else (active, {})
        if not active:
            break
        generator.batch_rollout_generate_response([rollouts[i] for i in active], **prompts)
        for i in active:
            rollouts[i].metadata["turns"] += 1
        results = list(pool.map(lambda i: _step(env, rollouts[i]), active))
        still = []
        for i, (msgs, done, error) in zip(active, results, strict=True):
            rollouts[i].add_messages(*msgs)
            if error is not None:
                rollouts[i].metadata["env_error"] = error
                _finish(rollouts[i], "env_error")
            elif done:
                _finish(rollouts[i], "env")
            else:
                still.append(i)
        active = still
    for i in active:
        _finish(rollouts[i], "max_turns")
