"""verifiers environments (`verifiers.v1`) run against the gateway, as scored rollouts (the `verifiers` extra).

    from SimpleTorchLLMRL.integrations.verifiers import collect

    batch = collect("my-taskset", gateway, tasks=4, group_size=8)      # an env id, or a verifiers Env
    loss = grpo.calculate_loss(batch.rollouts, batch.rewards)

verifiers runs each episode's agent (its harness: a chat program for the `null` harness) against an
OpenAI-compatible endpoint; `collect` serves the in-process `Gateway` for it, so every model call is
sampled by the policy and recorded with its token ids and log-probs. verifiers names each trace's calls
with its id (the `X-Session-ID` header), which is the gateway's session: the trace's rewards join its
rollouts exactly (`Gateway.take`). A trace that failed (an error, a signal left unscored, no recorded call)
is dropped and counted, never scored 0.

The token path (`token_path=True`, prime-rl's client): verifiers renders each prompt to ids itself (its
renderer, on the gateway tokenizer's chat template) and calls the gateway's POST /inference/v1/generate,
which records the ids as a token session. Each trace branch (verifiers' training sample) becomes a
conversation rollout: its messages, with the recorded replies (ids, log-probs) as its MODEL turns. The join
is checked token by token: `encode_rollout` of that rollout must give exactly the ids the gateway recorded
and verifiers trains on, with the loss on exactly verifiers' sampled tokens; a trace where it does not (a
renderer that renders other than the chat template) is dropped and counted, naming the first token that
differs.

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

from SimpleTorchLLMRL.chat.message import MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_rollout
from SimpleTorchLLMRL.integrations._extras import require

API_KEY_VAR = "SIMPLETORCHLLMRL_GATEWAY_KEY"  # the gateway takes any key; verifiers reads it from this variable


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
    token_path: the token-in/token-out client (prime-rl's `client.type = "train"`), rendering prompts with the
    tokenizer at `gateway.tokenizer.name_or_path`. max_concurrent: episodes at once (None: all).
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    vf = require("verifiers.v1", "verifiers")
    renderer = _renderer_model(gateway) if token_path else None
    env = load_env(vf, env)
    chosen = _tasks(env, tasks)
    with gateway.serve() as url:
        client = (vf.TrainClientConfig(base_url=url, api_key_var=API_KEY_VAR, renderer_model_name=renderer)
                  if token_path else vf.EvalClientConfig(base_url=url, api_key_var=API_KEY_VAR))
        context = vf.ModelContext(model=gateway.model_name, client=client,
                                  sampling=vf.SamplingConfig(**dict(sampling or {})))
        episodes = _run(env, chosen, group_size, context, max_concurrent)
    return _scored(gateway, chosen, episodes, group_size, token_path)


def _renderer_model(gateway) -> str:
    """What verifiers' renderer loads its tokenizer from on the token path: the gateway tokenizer's name."""
    source = getattr(gateway.tokenizer, "name_or_path", None)
    if not source:
        raise ValueError(f"token_path=True renders prompts with the gateway's tokenizer loaded by name, and this one "
                         f"has none (tokenizer.name_or_path is {source!r}): load it with from_pretrained")
    return str(source)


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


def _scored(gateway, tasks: list, episodes: list, group_size: int, token_path: bool) -> Collected:
    """Each good trace's rollouts with its rewards; every trace's session taken off the gateway."""
    taken = gateway.take([trace.id for episode in episodes for trace in episode.traces])  # one session a trace
    rollouts, errors = [], []
    for k, episode in enumerate(episodes):
        task = tasks[k // group_size]
        if not episode.traces:
            why = episode.errors[-1].message if episode.errors else "no trace"
            errors.append(f"task {task.key[:12]}: the episode ran no agent ({why})")
        for trace in episode.traces:
            recorded = taken[trace.id]
            problem = _problem(episode, trace, recorded)
            if problem is None and token_path:
                recorded, problem = _joined(gateway.tokenizer, trace, recorded)
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


# ----------------------------------------------------------------------------- the token path


def _joined(tokenizer, trace, recorded: list[Rollout]) -> tuple[list[Rollout], str | None]:
    """Each trainable branch of a token-path trace as a conversation rollout whose MODEL turns are the gateway's
    recorded replies, checked against the recorded ids; (rollouts, None), or ([], why it cannot be trained)."""
    by_ids = {tuple(t for m in r for t in m.token_ids): r for r in recorded}
    out = []
    for branch in (b for b in trace.branches if b.trainable):
        ids = tuple(branch.token_ids)
        record = by_ids.get(ids)
        if record is None:
            return [], f"branch {branch.index}: no recorded token session holds its {len(ids)} ids"
        replies = [m for m in record if m.type is MessageType.MODEL]
        if len(replies) != sum(node.sampled for node in branch.nodes):
            return [], f"branch {branch.index}: {len(replies)} recorded replies for its sampled messages"
        rollout = _conversation(branch, replies)
        problem = _differs(tokenizer, rollout, list(ids), branch.sampled_mask)
        if problem is not None:
            return [], f"branch {branch.index}: {problem}"
        rollout.metadata["session"] = record.metadata["session"]
        out.append(rollout)
    return out, None


def _conversation(branch, replies: list) -> Rollout:
    """The branch's messages, its sampled ones replaced by the recorded replies (ids, log-probs, temperature)."""
    from verifiers.v1.clients.train import tool_to_wire
    from verifiers.v1.dialects.chat import message_to_wire

    from SimpleTorchLLMRL.gateway.chat import normalize_message
    from SimpleTorchLLMRL.gateway.sessions import to_message

    replies = iter(replies)
    messages = [next(replies) if node.sampled else to_message(normalize_message(message_to_wire(node.message), i))
                for i, node in enumerate(branch.nodes)]
    tools = [tool_to_wire(t) for t in branch.tools]
    return Rollout(messages, {"tools": tools} if tools else {})


def _differs(tokenizer, rollout: Rollout, ids: list[int], sampled: list[bool]) -> str | None:
    """None when `encode_rollout` gives exactly `ids` with the loss on exactly the `sampled` tokens; else where not."""
    try:
        enc = encode_rollout(rollout, tokenizer)
    except ValueError as e:
        return f"encode_rollout refuses its conversation: {e}"
    if enc.input_ids != ids:
        at = next((t for t, (a, b) in enumerate(zip(enc.input_ids, ids, strict=False)) if a != b),
                  min(len(ids), len(enc)))
        return (f"its ids as verifiers' renderer built them differ from encode_rollout's at token {at} "
                f"({len(ids)} vs {len(enc)} tokens): the renderer renders other than this tokenizer's chat template")
    if enc.loss_mask != [int(s) for s in sampled]:
        return "encode_rollout's loss mask differs from verifiers' sampled tokens"
    return None
