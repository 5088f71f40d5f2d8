"""Sessions: one agent episode per API key (or X-Session-Id), its calls recorded as `Rollout`s.

After each call a session holds its *branch*: the prompt messages of that call and the n
replies sampled for it (MODEL messages carrying their sampled ids and log-probs). The next
call of the session either

- **merges**: its messages are the branch's messages followed by one of the replies, as the
  client was shown it (content and tool calls; arguments compared as parsed JSON, ids and
  whitespace around the content ignored; so is the `name` a named agent replays it with, which
  the MODEL message keeps as the agent), followed by new messages, with the same tools and
  template options. The prompt is then that reply's conversation plus the new messages, so a
  sampled turn is never re-rendered: the encoder places its ids as sampled. The other replies
  become finished rollouts of their own.
- or **forks**: anything else (an edited, dropped or summarized message, other tools). Every
  reply of the branch becomes a finished rollout, and the new call starts a new branch whose
  earlier assistant messages are context, not trained: they were sampled, if at all, under
  another prompt.

An assistant message the client wrote itself is always context (trainable=False).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field, replace

from SimpleTorchLLMRL.chat.message import Message, Rollout
from SimpleTorchLLMRL.gateway.openai_format import ChatRequest, to_message


def view(turn: dict) -> tuple:
    """What identifies a normalized message when a client sends it back. An assistant message's
    `name` is left out: agent frameworks (LangGraph, langchain `name=`) add it when they replay a reply."""
    role = turn["role"]
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in turn.get("tool_calls") or [])
    content = (turn.get("content") or "").strip() if role == "assistant" else turn.get("content")
    name = None if role == "assistant" else turn.get("name")
    return role, content, name, turn.get("tool_call_id") if role == "tool" else None, calls


def shown_view(content: str | None, tool_calls: list[dict]) -> tuple:
    """`view` of a reply as the client was shown it (tool-call arguments there are JSON strings)."""
    calls = [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
             for c in tool_calls]
    return view({"role": "assistant", "content": content or "", "tool_calls": calls})


def options_of(req: ChatRequest) -> str:
    """The call's tools and template options, as one comparable string."""
    return json.dumps([req.tools, req.template_kwargs], sort_keys=True, default=str)


def named(reply: Message, name: str | None) -> Message:
    """The sampled reply as the agent `name` the client gave it when replaying it (a copy; ids kept)."""
    return reply if name is None or name == reply.name else replace(reply, name=name)


@dataclass
class Branch:
    prompt: Rollout  # the last call's prompt messages (earlier replies as sampled) and metadata
    views: list[tuple]  # view of each prompt message as the client sends it
    replies: list[Message]  # the n sampled replies
    shown: list[tuple]  # view of each reply as the client was shown it
    options: str  # tools and template options of the call

    def rollout(self, j: int) -> Rollout:
        return Rollout([*self.prompt.messages, self.replies[j]], dict(self.prompt.metadata))

    def rollouts(self) -> list[Rollout]:
        return [self.rollout(j) for j in range(len(self.replies))]


@dataclass
class Plan:
    """What one call generates from, and what it closes."""

    prompt: Rollout
    views: list[tuple]
    closed: list[Rollout]
    merged: bool
    options: str  # options_of the request


@dataclass
class Session:
    name: str
    finished: list[Rollout] = field(default_factory=list)
    branch: Branch | None = None
    calls: int = 0

    def plan(self, req: ChatRequest) -> Plan:
        """Merge onto the branch when the request extends it by one of its replies; fork otherwise."""
        b, views, options = self.branch, [view(t) for t in req.chat], options_of(req)
        metadata = {"session": self.name, **({"tools": req.tools} if req.tools else {}),
                    **({"chat_template_kwargs": req.template_kwargs} if req.template_kwargs else {})}
        if b is not None and b.options == options:
            k = len(b.views)
            if len(views) > k and views[:k] == b.views and views[k] in b.shown:
                j = b.shown.index(views[k])
                closed = [b.rollout(i) for i in range(len(b.replies)) if i != j]
                messages = [*b.prompt.messages, named(b.replies[j], req.chat[k].get("name")),
                            *(to_message(t) for t in req.chat[k + 1:])]
                return Plan(Rollout(messages, metadata), views, closed, True, options)
        closed = b.rollouts() if b is not None else []
        return Plan(Rollout([to_message(t) for t in req.chat], metadata), views, closed, False, options)

    def record(self, plan: Plan, replies: list[Message], shown: list[tuple]) -> None:
        self.finished.extend(plan.closed)
        self.branch = Branch(plan.prompt, plan.views, replies, shown, plan.options)
        self.calls += 1

    def open_rollouts(self) -> list[Rollout]:
        """The last call's rollouts, one per reply (not final: the next call may extend one)."""
        return self.branch.rollouts() if self.branch else []

    def rollouts(self) -> list[Rollout]:
        return [*self.finished, *self.open_rollouts()]


class SessionStore:
    """Sessions by name, safe to use from the server's threads and the caller's."""

    def __init__(self):
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Session:
        with self._lock:
            return self._sessions.setdefault(name, Session(name))

    def record(self, session: Session, plan: Plan, replies: list[Message], shown: list[tuple]) -> None:
        """`session.record` under the store's lock, so a reader never sees half a call."""
        with self._lock:
            session.record(plan, replies, shown)

    def names(self) -> list[str]:
        with self._lock:
            return [n for n, s in self._sessions.items() if s.calls]

    def rollouts(self, name: str) -> list[Rollout]:
        with self._lock:
            s = self._sessions.get(name)
            if s is None or not s.calls:
                raise KeyError(f"no session {name!r}; sessions: {[n for n, x in self._sessions.items() if x.calls]}")
            return [r.copy() for r in s.rollouts()]

    def pop(self, name: str) -> Session | None:
        with self._lock:
            return self._sessions.pop(name, None)

    def pop_all(self) -> list[Session]:
        with self._lock:
            out = list(self._sessions.values())
            self._sessions.clear()
            return out

