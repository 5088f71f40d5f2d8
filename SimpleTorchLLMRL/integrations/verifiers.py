"""verifiers environments (`verifiers.v1`) run against the gateway, as scored rollouts (the `verifiers` extra).

    from SimpleTorchLLMRL.integrations.verifiers import collect

    batch = collect("my-taskset", gateway, tasks=4, group_size=8)      # an env id, or a verifiers Env
    loss = grpo.calculate_loss(batch.rollouts, batch.rewards)

verifiers runs each episode's agent (its harness: a chat program for the `null` harness) against an
OpenAI-compatible endpoint; `collect` serves the in-process `Gateway` for it, so every model call is
sampled by the policy and recorded with its token ids and log-probs. verifiers names each trace's calls
with its id (the `X-Session-ID` header), which is the gateway's session: the trace's rewards join its
rollouts exactly. A trace that failed (an error, a signal left unscored, no recorded call) is dropped and
counted, never scored 0.

verifiers 0.4.0 pins mcp==2.0.0 and openai<3: it lives in an environment of its own
(`integrations_envs/verifiers/`, docs/environments.md).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.integrations._extras import require

API_KEY_VAR = "SIMPLETORCHLLMRL_GATEWAY_KEY"  # the gateway takes any key; verifiers reads it from this variable
TOKEN_ROUTE = "POST /inference/v1/generate"


@dataclass
class Collected:
    """What `collect` returns. Each rollout's metadata: "reward" (the trace's weighted sum), "rewards"
    ({signal: score}), "metrics", "group_id" (its task's key), "trace_id", "task" (the task's data)."""

    rollouts: list[Rollout]
    rewards: torch.Tensor  # (B,) float32: each rollout's metadata["reward"]
    failed: int = 0  # traces dropped
    errors: list[str] = field(default_factory=list)  # why each was dropped, one line each


def collect(env, gateway, *, tasks: int | Iterable, group_size: int, sampling: Mapping[str, Any] | None = None,
            token_path: bool = False, max_concurrent: int | None = None) -> Collected:
    """Run `group_size` episodes of each task of a verifiers env through `gateway`; their scored rollouts.

    env: a `verifiers.v1.Env`, or a taskset id (an installed taskset package), run by the plain chat
    harness (`null`) in local subprocesses. tasks: the first N tasks of its taskset, or the tasks
    themselves. sampling: verifiers' sampling options for every call (temperature, max_tokens, ...).
    token_path: the token-in/token-out client (prime-rl's); needs the gateway's token route.
    max_concurrent: episodes at once (None: all).
    """
    if token_path:
        raise NotImplementedError(f"verifiers' token path needs the gateway's {TOKEN_ROUTE} route, which this "
                                  "gateway does not serve yet; use the chat path (token_path=False)")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    vf = require("verifiers.v1", "verifiers")
    env = load_env(vf, env)
    chosen = _tasks(env, tasks)
    with gateway.serve() as url:
        context = vf.ModelContext(model=gateway.model_name, client=vf.EvalClientConfig(
            base_url=url, api_key_var=API_KEY_VAR), sampling=vf.SamplingConfig(**dict(sampling or {})))
        episodes = _run(env, chosen, group_size, context, max_concurrent)
    return _scored(gateway, chosen, episodes, group_size)


def load_env(vf, env):
    """A verifiers Env as given, or the SingleAgentEnv of a taskset id (chat harness, local subprocesses)."""
    if isinstance(env, str):
        config = vf.resolve_env_config({"taskset": {"id": env},
                                        "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}})
        return vf.load_environment(config)
    if not isinstance(env, vf.Env):
        raise TypeError(f"env must be a verifiers.v1.Env or a taskset id, got {type(env).__name__}")
    return env


def _tasks(env, tasks) -> list:
    if isinstance(tasks, bool):
        raise TypeError("tasks must be a count or the tasks themselves, got a bool")
    if isinstance(tasks, int):
        if tasks < 1:
            raise ValueError(f"tasks must be a positive count, got {tasks}")
        chosen = list(env.taskset.take(tasks))
    else:
        chosen = list(tasks)
    if not chosen:
        raise ValueError("no tasks to run: the taskset is empty")
    return chosen


def _run(env, tasks: list, group_size: int, context, max_concurrent: int | None) -> list:
    """Every episode, task-major, run on an event loop of its own thread (a caller's loop is left alone)."""

    async def run_all():
        gate = asyncio.Semaphore(max_concurrent) if max_concurrent else None
        async with env.serving():
            slots = [slot for task in tasks for slot in env.slots(task, group_size)]
            return await asyncio.gather(*(env.run_slot(slot, context, gate) for slot in slots))

    os.environ.setdefault(API_KEY_VAR, "EMPTY")
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifiers") as pool:
        return pool.submit(asyncio.run, run_all()).result()


def _scored(gateway, tasks: list, episodes: list, group_size: int) -> Collected:
    """Each good trace's rollouts with its rewards; every trace's session taken off the gateway."""
    rollouts, errors = [], []
    for k, episode in enumerate(episodes):
        task = tasks[k // group_size]
        if not episode.traces:
            why = episode.errors[-1].message if episode.errors else "no trace"
            errors.append(f"task {task.key[:12]}: the episode ran no agent ({why})")
        for trace in episode.traces:
            recorded = gateway.clear(trace.id)  # the trace's calls, one session
            problem = _problem(episode, trace, recorded)
            if problem is not None:
                errors.append(f"trace {trace.id}: {problem}")
                continue
            for r in recorded:
                r.metadata.update(reward=float(trace.reward), group_id=task.key, trace_id=trace.id,
                                  rewards={name: float(v.score) for name, v in trace.rewards.items()},
                                  metrics=dict(trace.metrics), task=task.data.model_dump(mode="json"))
            rollouts += recorded
    rewards = torch.tensor([r.metadata["reward"] for r in rollouts], dtype=torch.float32)  # (B,)
    return Collected(rollouts, rewards, failed=len(errors), errors=errors)


def _problem(episode, trace, recorded: list) -> str | None:
    """Why a trace cannot be trained on, or None."""
    if trace.errors or not trace.ok:
        last = trace.errors[-1] if trace.errors else None
        return f"failed ({last.type}: {last.message})" if last else "failed"
    if episode.errors:
        return f"its episode failed ({episode.errors[-1].message})"
    unscored = [name for name, value in trace.rewards.items() if value is None]
    if unscored:
        return f"signals {unscored} were not scored"
    if not trace.rewards:
        return "it has no reward signal"
    if not recorded:
        return "the gateway recorded no call of it"
    return None
