"""Sessions: one agent episode per API key (or X-Session-Id), its calls recorded as `Rollout`s.

After each call a session holds its *branch*: the call's prompt messages and its n sampled replies. The next
call merges onto one reply (sent back as the client was shown it) or forks; token calls by the same rules on
ids (`tokens.plan_ids`). A call named by X-Session-Id goes to that session; one named by its API key joins
the idle session of that key whose branch it extends, else starts a new one (`SessionStore.open`). Sessions
idle past `ttl`, or least recently used past `max_sessions`, are finished: open rollouts to `on_finish`.
Links name a value (a response id's conversation) while their session lives, its last `MAX_LINKS` only.
The rules and why: docs/gateway.md, "Sessions".
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.gateway.request import GenRequest
from SimpleTorchLLMRL.gateway.tokens import TOKENS, continued, plan_ids

MAX_LINKS = 256  # links a session keeps (its latest responses); older ones are forgotten


def view(turn: dict) -> tuple:
    """What identifies a normalized message when a client sends it back. An assistant message's
    `name` is left out: agent frameworks (LangGraph, langchain `name=`) add it when they replay a reply."""
    role = turn["role"]
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in turn.get("tool_calls") or [])
    content = (turn.get("content") or "").strip() if role == "assistant" else turn.get("content")
    name = None if role == "assistant" else turn.get("name")
    return role, content, name, turn.get("tool_call_id") if role == "tool" else None, calls


def to_message(turn: dict) -> Message:
    """A normalized message as a `Message`. An assistant turn the client sent is context: not trained."""
    kind = MessageType.from_role(turn["role"])
    return Message(turn["content"], kind, name=turn.get("name"), tool_calls=turn.get("tool_calls"),
                   tool_call_id=turn.get("tool_call_id"), trainable=False if kind is MessageType.MODEL else None)


def shown_view(content: str | None, tool_calls: list[dict]) -> tuple:
    """`view` of a reply as the client was shown it (tool-call arguments there are JSON strings)."""
    calls = [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
             for c in tool_calls]
    return view({"role": "assistant", "content": content or "", "tool_calls": calls})


def options_of(req: GenRequest) -> str:
    """The call's tools and template options, as one comparable string (TOKENS for a call of token ids)."""
    if req.tokens is not None:
        return TOKENS
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
    id: int = 0  # the store's number for it (creation order)
    explicit: bool = False  # named by X-Session-Id (forks), else by API key (matched by prefix)
    busy: int = 0  # calls in flight: a busy session is never finished
    last_used: float = 0.0
    links: list[str] = field(default_factory=list)  # keys linked to it (SessionStore.link), oldest first

    def plan(self, req: GenRequest) -> Plan:
        """Merge onto the branch when the request extends it by one of its replies; fork otherwise."""
        if req.tokens is not None:
            messages, closed, merged = plan_ids(self.branch, req.tokens)
            return Plan(Rollout(messages, {"session": self.name, "prompt": TOKENS}), [tuple(req.tokens)], closed,
                        merged, TOKENS)
        b, views, options = self.branch, [view(t) for t in req.messages], options_of(req)
        metadata = {"session": self.name, **({"tools": req.tools} if req.tools else {}),
                    **({"chat_template_kwargs": req.template_kwargs} if req.template_kwargs else {})}
        if b is not None and b.options == options:
            k = len(b.views)
            if len(views) > k and views[:k] == b.views and views[k] in b.shown:
                j = b.shown.index(views[k])
                closed = [b.rollout(i) for i in range(len(b.replies)) if i != j]
                messages = [*b.prompt.messages, named(b.replies[j], req.messages[k].get("name")),
                            *(to_message(t) for t in req.messages[k + 1:])]
                return Plan(Rollout(messages, metadata), views, closed, True, options)
        closed = b.rollouts() if b is not None else []
        return Plan(Rollout([to_message(t) for t in req.messages], metadata), views, closed, False, options)

    def record(self, plan: Plan, replies: list[Message], shown: list[tuple]) -> None:
        self.finished.extend(plan.closed)
        self.branch = Branch(plan.prompt, plan.views, replies, shown, plan.options)
        self.calls += 1

    def open_rollouts(self) -> list[Rollout]:
        """The last call's rollouts, one per reply (not final: the next call may extend one)."""
        return self.branch.rollouts() if self.branch else []

    def rollouts(self) -> list[Rollout]:
        return [*self.finished, *self.open_rollouts()]


def _branch_keys(s: Session) -> list[tuple]:
    """The index keys of a session's branch: one per reply the client may continue."""
    b = s.branch
    if b is None or b.options == TOKENS:  # token branches are matched by id prefix (`SessionStore._match`)
        return []
    prefix = tuple(b.views)
    return [(s.name, b.options, prefix, shown) for shown in set(b.shown)]


class SessionStore:
    """Sessions, safe to use from the server's threads and the caller's.

    ttl: seconds a session may stay idle before it is finished (None: never). max_sessions: open
    sessions past this many finish the least recently used idle ones (None: no cap). on_finish:
    called with the open rollouts of each session finished so (by `expire`, the cap, or never
    when both are None). clock: the time source (tests pass a fake one).
    """

    def __init__(self, *, ttl: float | None = None, max_sessions: int | None = None,
                 on_finish: Callable[[list[Rollout]], None] | None = None, clock: Callable[[], float] = time.monotonic):
        if ttl is not None and not ttl > 0:
            raise ValueError(f"ttl must be a positive number of seconds or None, got {ttl!r}")
        if max_sessions is not None and (isinstance(max_sessions, bool) or not isinstance(max_sessions, int)
                                         or max_sessions < 1):
            raise ValueError(f"max_sessions must be a positive int or None, got {max_sessions!r}")
        self.ttl, self.max_sessions, self.on_finish, self.clock = ttl, max_sessions, on_finish, clock
        self._sessions: OrderedDict[int, Session] = OrderedDict()  # least recently used first
        self._named: dict[str, int] = {}  # X-Session-Id -> its session
        self._index: dict[tuple, list[int]] = {}  # (name, options, prefix views, reply view) -> sessions
        self._links: dict[str, tuple[int, Any]] = {}  # key -> (session, value), while the session lives
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.finished_sessions = 0  # how many were finished by the TTL or the cap (for tests and logs)

    # -------------------------------------------------------------- one call

    def open(self, name: str, req: GenRequest, *, explicit: bool = True) -> tuple[Session, Plan]:
        """The session the call belongs to (marked busy until `release`) and its plan.

        explicit: the name is an X-Session-Id: one session, merge or fork. Otherwise the call joins
        the idle session of `name` whose branch it extends, or starts a new one."""
        with self._lock:
            s = None
            if explicit:
                sid = self._named.get(name)
                s = self._sessions.get(sid) if sid is not None else None
            else:
                s = self._match(name, req)
            if s is None:
                s = Session(name, id=next(self._ids), explicit=explicit)
                self._sessions[s.id] = s
                if explicit:
                    self._named[name] = s.id
            s.busy += 1
            self._touch(s)
            plan = s.plan(req)
            evicted = self._evict()
        self._finish(evicted)
        return s, plan

    def _match(self, name: str, req: GenRequest) -> Session | None:
        """The idle session of `name` whose branch the request extends by one of its replies (longest first; a
        call of token ids: the least recently used of that name's sessions that it continues)."""
        if req.tokens is not None:
            return next((s for s in self._sessions.values()
                         if s.name == name and not s.busy and continued(s.branch, req.tokens) is not None), None)
        views, options = [view(t) for t in req.messages], options_of(req)
        for k in range(len(views) - 1, -1, -1):
            if views[k][0] != "assistant":
                continue
            for sid in self._index.get((name, options, tuple(views[:k]), views[k]), ()):
                s = self._sessions.get(sid)
                if s is not None and not s.busy:
                    return s
        return None

    def record(self, session: Session, plan: Plan, replies: list[Message], shown: list[tuple]) -> None:
        """`session.record` under the store's lock, so a reader never sees half a call."""
        with self._lock:
            self._unindex(session)
            session.record(plan, replies, shown)
            if session.id not in self._sessions:  # cleared or closed while the call ran
                return
            self._touch(session)
            if not session.explicit:
                for key in _branch_keys(session):
                    self._index.setdefault(key, []).append(session.id)

    def release(self, session: Session) -> None:
        """The call is over (answered or not). A session that never recorded a call is dropped."""
        with self._lock:
            session.busy -= 1
            if session.id not in self._sessions:  # finished meanwhile (clear, close)
                return
            self._touch(session)
            if not session.busy and not session.calls:
                self._drop(session)

    def link(self, key: str, session: Session, value: Any) -> bool:
        """Remember `value` under `key` for as long as `session` lives (its last MAX_LINKS keys only);
        False when the session is already finished."""
        with self._lock:
            if self._sessions.get(session.id) is not session:
                return False
            self._links[key] = (session.id, value)
            session.links.append(key)
            for old in session.links[:-MAX_LINKS]:
                self._links.pop(old, None)
            del session.links[:-MAX_LINKS]
            return True

    def linked(self, key: str) -> tuple[Session, Any] | None:
        """(session, value) linked to `key`, or None when unknown or its session was finished."""
        with self._lock:
            sid, value = self._links.get(key, (None, None))
            s = self._sessions.get(sid) if sid is not None else None
            return (s, value) if s is not None else None

    # -------------------------------------------------------------- finishing

    def expire(self) -> int:
        """Finish the sessions idle past the TTL; returns how many."""
        if self.ttl is None:
            return 0
        with self._lock:
            now, out = self.clock(), []
            for s in list(self._sessions.values()):  # least recently used first
                if now - s.last_used <= self.ttl:
                    break
                if not s.busy:
                    out.append(self._drop(s))
        self._finish(out)
        return len(out)

    def _evict(self) -> list[Session]:
        """Past the cap, drop the least recently used idle sessions (under the lock; finished by the caller)."""
        out = []
        if self.max_sessions is None:
            return out
        over = len(self._sessions) - self.max_sessions
        for s in list(self._sessions.values()):
            if over <= 0:
                break
            if not s.busy:
                out.append(self._drop(s))
                over -= 1
        return out

    def _finish(self, sessions: list[Session]) -> None:
        rollouts = [r for s in sessions for r in s.open_rollouts()]
        self.finished_sessions += len(sessions)
        if rollouts and self.on_finish is not None:
            self.on_finish(rollouts)

    def _touch(self, s: Session) -> None:
        s.last_used = self.clock()
        self._sessions.move_to_end(s.id)

    def _unindex(self, s: Session) -> None:
        for key in _branch_keys(s):
            ids = self._index.get(key)
            if ids is not None and s.id in ids:
                ids.remove(s.id)
                if not ids:
                    del self._index[key]

    def _drop(self, s: Session) -> Session:
        self._unindex(s)
        for key in s.links:
            self._links.pop(key, None)
        self._sessions.pop(s.id, None)
        if self._named.get(s.name) == s.id:
            del self._named[s.name]
        return s

    # -------------------------------------------------------------- reading

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def _of(self, name: str) -> list[Session]:
        return sorted((s for s in self._sessions.values() if s.name == name and s.calls), key=lambda s: s.id)

    def names(self) -> list[str]:
        """Names (X-Session-Id or API key) with at least one recorded call, in order of their first session."""
        with self._lock:
            live = sorted((s for s in self._sessions.values() if s.calls), key=lambda s: s.id)
            return list(dict.fromkeys(s.name for s in live))

    def rollouts(self, name: str) -> list[Rollout]:
        """Every rollout of every open session of `name`, oldest session first."""
        with self._lock:
            sessions = self._of(name)
            if not sessions:
                raise KeyError(f"no session {name!r}; sessions: "
                               f"{list(dict.fromkeys(s.name for s in self._sessions.values() if s.calls))}")
            return [r.copy() for s in sessions for r in s.rollouts()]

    def take(self, names: list[str]) -> dict[str, list[Session]]:
        """Forget every session of each name; returns them by name (oldest first; [] for a name without one).
        A ValueError, taking nothing, when one of them has a call in flight (its reply would be lost)."""
        wanted = set(names)
        with self._lock:
            out = {name: [] for name in names}
            for s in sorted((s for s in self._sessions.values() if s.name in wanted), key=lambda s: s.id):
                out[s.name].append(s)
            busy = [name for name, sessions in out.items() if any(s.busy for s in sessions)]
            if busy:
                raise ValueError(f"sessions {busy} have a call in flight: take them once their calls are answered")
            for sessions in out.values():
                for s in sessions:
                    self._drop(s)
            return out

    def sizes(self) -> list[dict]:
        """Each name with a recorded call: its calls, rollouts, calls in flight and seconds since its last call."""
        with self._lock:
            now, out = self.clock(), {}
            for s in sorted((s for s in self._sessions.values() if s.calls), key=lambda s: s.id):
                size = out.setdefault(s.name, {"id": s.name, "calls": 0, "rollouts": 0, "in_flight": 0,
                                               "idle_seconds": now - s.last_used})
                size["calls"] += s.calls
                size["rollouts"] += len(s.finished) + (len(s.branch.replies) if s.branch else 0)
                size["in_flight"] += s.busy
                size["idle_seconds"] = 0.0 if size["in_flight"] else min(size["idle_seconds"], now - s.last_used)
            return list(out.values())

    def pop_all(self) -> list[Session]:
        with self._lock:
            out = list(self._sessions.values())
            self._sessions.clear()
            self._named.clear()
            self._index.clear()
            self._links.clear()
            return out
