"""Multi-agent rollouts: several named agents speak (MODEL messages with `name=`); chosen agents train.

    debate = Rollout([Message("Is 91 prime?", MessageType.MESSAGE)])
    for speaker in ["A", "B", "A"]:
        take_turn(debate, speaker, respond=generator.rollout_generate_response)
    batch_a = rollouts_to_batch([view_for_agent(debate, "A")], tokenizer)   # trains A only

`set_trainable_agents` trains chosen agents in the shared transcript; `view_for_agent` renders the others'
turns as user messages "[B]: ..." (docs/multi_policy.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout

DEFAULT_TEMPLATE = "[{name}]: {content}"


def agent_message(content: str, name: str, *, trainable: bool | None = None, **kwargs) -> Message:
    """A MODEL turn spoken by agent `name` (other Message keyword arguments pass through)."""
    _check_name(name)
    return Message(content, MessageType.MODEL, name=name, trainable=trainable, **kwargs)


def _check_name(name) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"an agent name must be a non-empty str, got {name!r}")


def _agent_set(agents: str | Iterable[str]) -> frozenset[str]:
    names = frozenset([agents] if isinstance(agents, str) else agents)
    for n in names:
        _check_name(n)
    return names


def agents_in(rollout: Rollout) -> list[str]:
    """Names of the agents with MODEL turns, in order of first appearance."""
    seen: dict[str, None] = {}
    for m in rollout:
        if m.type is MessageType.MODEL and m.name is not None:
            seen.setdefault(m.name)
    return list(seen)


def agent_turns(rollout: Rollout, name: str) -> list[Message]:
    """The MODEL messages spoken by `name`, in order."""
    return [m for m in rollout if m.type is MessageType.MODEL and m.name == name]


def set_trainable_agents(rollout: Rollout, agents: str | Iterable[str], *, strict: bool = True,
                         inplace: bool = True) -> Rollout:
    """Mark each MODEL turn trainable iff its `name` is in `agents`; other messages are untouched.

    strict: a name in `agents` that never speaks, or a MODEL turn without a name, raises ValueError (a typo
    would otherwise silently train nothing). Returns the rollout (a copy when `inplace=False`).
    """
    chosen = _agent_set(agents)
    if strict:
        unnamed = [i for i, m in enumerate(rollout) if m.type is MessageType.MODEL and m.name is None]
        if unnamed:
            raise ValueError(f"MODEL messages {unnamed} have no name=; name every agent turn or pass strict=False")
        missing = sorted(chosen - set(agents_in(rollout)))
        if missing:
            raise ValueError(f"agents {missing} have no MODEL turn in this rollout (speakers: {agents_in(rollout)})")
    out = rollout if inplace else rollout.copy()
    for m in out:
        if m.type is MessageType.MODEL:
            m.trainable = m.name in chosen
    return out


def trainable_agents(rollout: Rollout) -> set[str | None]:
    """Names of the agents whose MODEL turns are currently trained (None for unnamed turns)."""
    return {m.name for m in rollout if m.type is MessageType.MODEL and m.is_trainable}


def render_turn(message: Message, template: str = DEFAULT_TEMPLATE) -> str:
    """Another agent's turn as text: `template.format(name=..., content=...)`."""
    return template.format(name=message.name if message.name is not None else "agent", content=message.content)


def view_for_agent(rollout: Rollout, agent: str, *, template: str = DEFAULT_TEMPLATE,
                   as_type: MessageType = MessageType.MESSAGE, train: bool = True) -> Rollout:
    """The conversation as `agent` sees it: its own turns as MODEL, everyone else's rendered as `as_type`.

    Own turns keep content, token_ids, logprobs and temperature, and are trainable
    iff `train`. Other agents' MODEL turns become `as_type` messages (user by default)
    with `render_turn` text, never trained; their sampled ids are dropped (they are
    re-tokenized as context). SYSTEM / user / TOOL messages and metadata are copied.
    """
    _check_name(agent)
    if as_type is MessageType.MODEL:
        raise ValueError("as_type must be a non-MODEL MessageType (the other agents' turns are context)")
    view = Rollout(metadata=rollout.copy().metadata)
    for m in rollout:
        if m.type is MessageType.MODEL and m.name == agent:
            view.add_messages(replace(m, trainable=train))
        elif m.type is MessageType.MODEL:
            view.add_messages(Message(render_turn(m, template), as_type, name=m.name, trainable=False))
        else:
            view.add_messages(replace(m))
    view.metadata["agent"] = agent
    return view


def views_by_agent(rollout: Rollout, agents: Iterable[str] | None = None, **kwargs) -> dict[str, Rollout]:
    """`{name: view_for_agent(rollout, name)}` for the given agents (default: every speaker)."""
    names = list(agents) if agents is not None else agents_in(rollout)
    return {n: view_for_agent(rollout, n, **kwargs) for n in names}


def take_turn(rollout: Rollout, agent: str, respond: Callable[[Rollout], Message], *,
              template: str = DEFAULT_TEMPLATE, trainable: bool | None = None, view: bool = True) -> Message:
    """Let `agent` speak: `respond(view_for_agent(rollout, agent))` -> Message, named and appended to `rollout`.

    `respond` is e.g. `ModelGenerate(...).rollout_generate_response`, or a scripted
    function for a fixed opponent. Its message is stored as a MODEL turn with
    `name=agent` (sampled ids and log-probs kept); returns that message.
    view=False: `respond` sees the shared transcript itself (every agent's turn as MODEL).
    """
    return take_turns([rollout], agent, lambda rs: [respond(rs[0])], template=template, trainable=trainable,
                      view=view)[0]


def take_turns(rollouts: Sequence[Rollout], agent: str, respond: Callable[[list[Rollout]], list[Message]], *,
               template: str = DEFAULT_TEMPLATE, trainable: bool | None = None, view: bool = True) -> list[Message]:
    """`take_turn` for a batch: one `respond(prompts)` call gives `agent`'s next turn in every rollout.

    `respond` maps a list of rollouts to one Message each, e.g.
    `lambda rs: [g[0] for g in generator.generate(rs, adapter=agent)]`. The prompts are
    `view_for_agent(r, agent)` (view=True) or the shared transcripts (view=False). Returns the appended messages.
    """
    _check_name(agent)
    rollouts = list(rollouts)
    prompts = [view_for_agent(r, agent, template=template) if view else r for r in rollouts]
    replies = list(respond(prompts))
    if len(replies) != len(rollouts):
        raise ValueError(f"respond returned {len(replies)} messages for {len(rollouts)} rollouts")
    out = []
    for r, reply in zip(rollouts, replies, strict=True):
        if not isinstance(reply, Message):
            raise TypeError(f"respond must return a Message, got {type(reply).__name__}")
        reply = replace(reply, type=MessageType.MODEL, name=agent, trainable=trainable)
        r.add_messages(reply)
        out.append(reply)
    return out
