"""Conversation objects: `MessageType`, `Message` and `Rollout` (messages plus a free-form `metadata` dict).

Only MODEL turns are trained unless `trainable=` says otherwise. Metadata keys the library reads:
"group_id" (the GRPO group, set by `collect_rollouts`), "tools" (JSON schemas for `apply_chat_template(tools=)`)
and "chat_template_kwargs" (more keyword arguments for the chat template).
"""

from __future__ import annotations

import copy as _copy
import itertools
import math
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class MessageType(Enum):
    """Who speaks. The value is the chat-template role.

    USER is another name for MESSAGE (the seed's spelling of the user turn): the same member,
    `MessageType.USER is MessageType.MESSAGE`, so files, roles and comparisons are unchanged.
    """

    SYSTEM = "system"
    MESSAGE = "user"
    USER = "user"  # an alias of MESSAGE (same value): iteration and names keep the four members
    MODEL = "assistant"
    TOOL = "tool"

    @property
    def role(self) -> str:
        return self.value

    @classmethod
    def from_role(cls, role: str | MessageType) -> MessageType:
        """`"assistant"` -> MODEL, ...; raises ValueError naming an unknown role."""
        if isinstance(role, MessageType):
            return role
        for name, member in cls.__members__.items():  # aliases (USER) included
            if role == member.value or (isinstance(role, str) and role.upper() == name):
                return member
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown role {role!r}; expected one of {allowed} or a MessageType")


FINISH_REASONS = ("stop", "length", "tool_call")
LOGPROB_SLACK = 1e-6  # how far above 0 a log-prob may round (a float32 log-softmax); past it, not a log-prob


def checked_logprobs(values) -> list[float]:
    """`values` as floats, each a log-probability: finite and <= LOGPROB_SLACK. A -inf trains to an infinite
    loss and a NaN gradient; a value above 0 is no probability at all. ValueError naming the first bad one."""
    out = [float(x) for x in values]
    for k, x in enumerate(out):
        if not (math.isfinite(x) and x <= LOGPROB_SLACK):
            raise ValueError(f"Message logprobs[{k}] is {x}: log-probabilities must be finite and <= 0 "
                             f"(up to {LOGPROB_SLACK:g} of rounding)")
    return out


@dataclass(eq=True)
class Message:
    """One turn of a conversation.

    `token_ids` / `logprobs`: what a generator sampled for a MODEL turn (stop/EOS token included), used
    verbatim (`content` is never re-tokenized); `temperature`: what those log-probs are under.
    `tool_calls`: structured calls of a MODEL turn (OpenAI style); `tool_call_id`: the call a TOOL message
    answers. `policy_version`: the weights that sampled it; `adapter`: the LoRA adapter that sampled it;
    `name`: the agent that speaks. `sampling`: what besides temperature changed the distribution it was
    drawn from (`SamplingConfig.distribution_changes`), None when nothing did (docs/generation.md).
    """

    content: str
    type: MessageType = MessageType.MESSAGE
    name: str | None = field(default=None, kw_only=True)
    trainable: bool | None = field(default=None, kw_only=True)
    token_ids: list[int] | None = field(default=None, kw_only=True)
    logprobs: list[float] | None = field(default=None, kw_only=True)
    tool_calls: list[dict[str, Any]] | None = field(default=None, kw_only=True)
    tool_call_id: str | None = field(default=None, kw_only=True)
    finish_reason: str | None = field(default=None, kw_only=True)
    temperature: float | None = field(default=None, kw_only=True)
    policy_version: int | None = field(default=None, kw_only=True)
    adapter: str | None = field(default=None, kw_only=True)
    sampling: dict[str, Any] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.content, str):
            raise TypeError(f"Message content must be a str, got {type(self.content).__name__}")
        self.type = MessageType.from_role(self.type)
        if self.trainable is not None and not isinstance(self.trainable, bool):
            raise TypeError(f"Message trainable must be True, False or None, got {self.trainable!r}")
        if self.token_ids is not None:
            self.token_ids = [int(t) for t in self.token_ids]
        if self.logprobs is not None:
            if self.token_ids is None:
                raise ValueError("Message logprobs given without token_ids: log-probs belong to sampled ids")
            if len(self.logprobs) != len(self.token_ids):
                raise ValueError(
                    f"Message token_ids and logprobs differ in length: "
                    f"{len(self.token_ids)} ids vs {len(self.logprobs)} logprobs"
                )
        if self.tool_call_id is not None and not isinstance(self.tool_call_id, str):
            raise TypeError(f"Message tool_call_id must be a str or None, got {type(self.tool_call_id).__name__}")
        if self.policy_version is not None and not isinstance(self.policy_version, int):
            raise TypeError(f"Message policy_version must be an int or None, got {self.policy_version!r}")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise TypeError(f"Message adapter must be a non-empty str or None, got {self.adapter!r}")
        if self.sampling is not None and (not isinstance(self.sampling, dict)
                                          or not all(isinstance(k, str) for k in self.sampling)):
            raise TypeError(f"Message sampling must be a dict with str keys or None, got {self.sampling!r:.80}")
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS} or None, got {self.finish_reason!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "logprobs" and value is not None:  # checked when set: at construction and after
            value = checked_logprobs(value)
        object.__setattr__(self, name, value)

    @property
    def role(self) -> str:
        return self.type.role

    @property
    def is_trainable(self) -> bool:
        """Explicit `trainable` wins; otherwise only MODEL turns are trained."""
        if self.trainable is not None:
            return self.trainable
        return self.type is MessageType.MODEL

    def to_dict(self) -> dict[str, Any]:
        """The chat-template form: role, content, and name / tool_calls / tool_call_id when set."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _text_content(content, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"chat turn {index}: only text content parts are supported, got {part!r:.80}")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"chat turn {index}: content must be a str, None or a list of text parts, "
                     f"got {type(content).__name__}")


class Rollout:
    """An ordered conversation plus metadata; the unit the trainer learns from."""

    def __init__(self, messages: Sequence[Message] = (), metadata: dict[str, Any] | None = None):
        self._messages: list[Message] = []
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.add_messages(*messages)

    @classmethod
    def from_chat(cls, chat: Sequence[dict[str, Any]], **metadata: Any) -> Rollout:
        """Build from role/content dicts: the inverse of `to_chat`, and OpenAI-style message lists.

        OpenAI forms accepted: `content` None (an assistant turn with only tool_calls), a list of
        `{"type": "text", "text": ...}` parts (joined), the "developer" role (a system message).
        """
        msgs = []
        for i, turn in enumerate(chat):
            if not isinstance(turn, dict) or "role" not in turn:
                raise ValueError(f"chat turn {i} needs a 'role' key, got {turn!r:.80}")
            role = "system" if turn["role"] == "developer" else turn["role"]
            msgs.append(Message(_text_content(turn.get("content"), i), MessageType.from_role(role),
                                name=turn.get("name"), tool_calls=turn.get("tool_calls"),
                                tool_call_id=turn.get("tool_call_id")))
        return cls(msgs, metadata)

    def add_messages(self, *msgs: Message) -> Rollout:
        for i, m in enumerate(msgs):
            if not isinstance(m, Message):
                raise TypeError(f"Rollout.add_messages argument {i} is a {type(m).__name__}, not a Message")
        self._messages.extend(msgs)
        return self

    @property
    def messages(self) -> list[Message]:
        return self._messages

    def __len__(self) -> int:
        return len(self._messages)

    def __getitem__(self, index):
        return self._messages[index]

    def __iter__(self) -> Iterator[Message]:
        return iter(self._messages)

    def __repr__(self) -> str:
        return f"Rollout({len(self)} messages, metadata keys={sorted(self.metadata)})"

    def to_dict(self) -> dict[str, Any]:
        """Everything about the rollout as JSON-ready data (see `chat.rollout_io`)."""
        return rollout_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rollout:
        """The inverse of `to_dict`."""
        return rollout_from_dict(d)

    def to_chat(self) -> list[dict[str, Any]]:
        return [m.to_dict() for m in self._messages]

    def copy(self) -> Rollout:
        """A deep copy: messages and metadata are independent of the original."""
        return _copy.deepcopy(self)

    @property
    def prompt_messages(self) -> list[Message]:
        """All messages before the first MODEL message (what GRPO groups on)."""
        return list(itertools.takewhile(lambda m: m.type is not MessageType.MODEL, self._messages))

    def last(self, type: MessageType | None = None) -> Message | None:
        """The last message, or the last of the given type; None when there is none."""
        for m in reversed(self._messages):
            if type is None or m.type is type:
                return m
        return None


def sampled_versions(rollouts: Iterable[Rollout]) -> list[int]:
    """The policy versions recorded on the sampled MODEL turns of `rollouts` (turns without one skipped)."""
    return [m.policy_version for r in rollouts for m in r if m.token_ids is not None and m.policy_version is not None]


# ---------------------------------------------------------------------- records (JSON-ready dicts; files in chat.rollout_io)

# Version 2 added Message.adapter, version 3 Message.sampling. A record is written with the lowest version
# that holds it (1 unless some message names an adapter or carries sampling changes), so files without them
# stay readable by older versions of the library.
FORMAT_VERSION = 3
SKIPPED_METADATA = ("env_state",)  # live environment objects from collect_rollouts
_FIELDS = ("name", "trainable", "token_ids", "logprobs", "tool_calls", "tool_call_id", "finish_reason",
           "temperature", "policy_version", "adapter", "sampling")
_SINCE = {"adapter": 2, "sampling": 3}  # fields newer than version 1: the version that introduced them


def message_to_dict(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    for f in _FIELDS:
        value = getattr(m, f)
        if value is not None:
            out[f] = value
    return out


def message_from_dict(d: dict[str, Any], version: int = FORMAT_VERSION) -> Message:
    known = {"role", "content", *(f for f in _FIELDS if _SINCE.get(f, 1) <= version)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"message record (format version {version}) has unknown fields {sorted(unknown)}")
    return Message(d["content"], MessageType.from_role(d["role"]), **{f: d[f] for f in _FIELDS if d.get(f) is not None})


def _json_value(value, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} is {value}: not representable in JSON")
    if value is None or isinstance(value, (str, int, float, bool)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _json_value(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where} has a non-str key {k!r}")
            _json_value(v, f"{where}[{k!r}]")
        return
    raise ValueError(f"{where} is a {type(value).__name__}, which a rollout file cannot hold; convert it to JSON "
                     "(str, numbers, bools, None, lists, dicts) or leave it out")


def rollout_to_dict(rollout: Rollout, skip_metadata: Iterable[str] = SKIPPED_METADATA) -> dict[str, Any]:
    """A JSON-ready dict of the rollout; raises ValueError naming a metadata key that is not JSON."""
    skip = set(skip_metadata)
    metadata = {k: v for k, v in rollout.metadata.items() if k not in skip}
    for k, v in metadata.items():
        if not isinstance(k, str):
            raise ValueError(f"metadata key {k!r} is not a str")
        _json_value(v, f"metadata[{k!r}]")
    messages = [message_to_dict(m) for m in rollout]
    version = max([1, *(_SINCE.get(f, 1) for m in messages for f in m)])
    return {"format_version": version, "messages": messages, "metadata": metadata}


def rollout_from_dict(d: dict[str, Any]) -> Rollout:
    version = d.get("format_version")
    if version is None or not isinstance(version, int):
        raise ValueError("not a rollout record: no format_version")
    if version > FORMAT_VERSION:
        raise ValueError(f"rollout record of format version {version}, newer than this library's "
                         f"{FORMAT_VERSION}; upgrade SimpleTorchLLMRL to read it")
    messages = []
    for i, m in enumerate(d["messages"]):
        try:
            messages.append(message_from_dict(m, version))
        except (ValueError, TypeError) as e:
            raise (TypeError if isinstance(e, TypeError) else ValueError)(f"message {i}: {e}") from e
    return Rollout(messages, d.get("metadata") or {})


# ---- do a MODEL turn's sampled ids hold the text its rewards read? (the reward reads the content, the
# gradient the ids: ids from another tokenizer, or of another text, would train what no reward judged)


def _comparable(text: str) -> str:
    """Text as two decodings of the same ids agree on: NFKC, case-folded, without whitespace (tokenizers
    normalize, and clean up spaces around punctuation, in their own ways)."""
    return "".join(unicodedata.normalize("NFKC", text).casefold().split())


def _decode_turns(tokenizer, turns: list) -> list[str]:
    """Each turn's ids decoded without special tokens, in one call (a fast tokenizer's Rust side when it has one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decode = backend.decode_batch if backend is not None else tokenizer.batch_decode
    return decode([m.token_ids for _, _, m in turns], skip_special_tokens=True)


def _in_vocabulary(tokenizer):
    """Does a list of ids hold only ids of `tokenizer`? (Others are the vocabulary check's to name.)"""
    try:
        size = len(tokenizer)
    except TypeError:
        return lambda ids: True
    return lambda ids: min(ids) >= 0 and max(ids) < size


def check_ids_decode(rollouts: list[Rollout], tokenizer) -> None:
    """ValueError naming the first MODEL turn whose content is not text its `token_ids` hold.

    The reward reads a turn's text and the gradient its ids: ids of another tokenizer (or text) would train
    what no reward judged. The content must be the ids decoded without special tokens, or a part of it (a
    stop string cuts it; a parser may keep a reasoning model's final answer), compared by `_comparable`.
    A turn with an id outside the vocabulary is left to the trainer's vocabulary check."""
    known = _in_vocabulary(tokenizer)
    turns = [(r, i, m) for r, rollout in enumerate(rollouts) for i, m in enumerate(rollout)
             if m.type is MessageType.MODEL and m.token_ids and known(m.token_ids)]
    if not turns:
        return
    decoded = _decode_turns(tokenizer, turns)
    for (r, i, m), text in zip(turns, decoded, strict=True):
        if text == m.content or _comparable(m.content) in _comparable(text):
            continue
        where = f"rollout {r}, message {i}" if len(rollouts) > 1 else f"message {i}"
        raise ValueError(f"{where}: its token_ids decode to {text!r:.120} but its content is {m.content!r:.120}: "
                         "ids from another tokenizer (or of another text) train what the reward never read. Pass "
                         "check_ids=False to encode_rollouts / rollouts_to_batch when they differ on purpose")
