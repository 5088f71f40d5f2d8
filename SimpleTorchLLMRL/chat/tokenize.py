"""Rollout -> token ids, loss mask and sampled log-probs; collate into a `Batch`.

Legend: B batch, T tokens.

With a chat template the rollout is rendered incrementally: message i's text
is `render(messages[:i+1])[len(render(messages[:i])):]`, split into
header | content | suffix by rendering a sentinel in place of the content. The
header and suffix are the template's own text; the content is the message's
text, or for a MODEL turn that carries `token_ids`, those ids verbatim (never
re-tokenized). A trainable turn's mask covers its content and its end-of-turn
token (the suffix's first token when that is a special token), never the
header nor any other message.

Without a chat template (GPT-2 style) the messages' texts are concatenated;
a MODEL turn without sampled ids ends with the EOS token (trained).

The invariant the generator relies on: `encode_prompt(rollout)` followed by
the ids it sampled is exactly a prefix of `encode_rollout(rollout + reply)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout

NAN = float("nan")
_SENTINEL = "\u2063STLR\u2063SENTINEL\u2063"  # invisible separators: never trimmed, never in real text


@dataclass
class EncodedRollout:
    """Token-level view of one rollout. All lists have the same length.

    old_logprobs[t] is the sampled log-prob of input_ids[t] (NaN where the
    token was not sampled by a generator); None when no message carries any.
    """

    input_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float] | None
    sampling_temperature: float | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class Batch:
    """Right-padded tensors, shape (B, T).

    input_ids      long  token ids (pad_token_id where padded)
    attention_mask long  1 on real tokens
    loss_mask      long  1 on trainable tokens
    old_logprobs   float sampled log-prob of input_ids[:, t], NaN where unknown; None if no rollout has any
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    sampling_temperature: float | None = None

    def to(self, device) -> Batch:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Batch(move(self.input_ids), move(self.attention_mask), move(self.loss_mask),
                     move(self.old_logprobs), self.sampling_temperature)

    def __getitem__(self, index) -> Batch:
        """Select rows (an int, slice or index tensor), e.g. for micro-batching."""
        if isinstance(index, int):
            index = slice(index, index + 1)
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return Batch(pick(self.input_ids), pick(self.attention_mask), pick(self.loss_mask),
                     pick(self.old_logprobs), self.sampling_temperature)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _render(tokenizer, chat: list[dict], rollout: Rollout, add_generation_prompt: bool) -> str:
    if not chat and not add_generation_prompt:
        return ""
    kwargs = dict(rollout.metadata.get("chat_template_kwargs") or {})
    tools = rollout.metadata.get("tools")
    return tokenizer.apply_chat_template(
        chat, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def _shape_key(chat: list[dict], i: int) -> tuple:
    """What a template's header/suffix for message i may depend on besides the prefix text."""
    m = chat[i]
    return (i == 0, m["role"], m.get("name"), repr(m.get("tool_calls")))


def _segments_with_template(rollout: Rollout, tokenizer, cache: dict) -> list[tuple[str, str, str]]:
    """(header, rendered content, suffix) text for each message, in order.

    Message i's text is render(messages[:i+1]) minus render(messages[:i]). Its
    header/suffix come from rendering a sentinel in place of the content; that
    split is cached per message shape and reused only when the real render is
    exactly prev + header + content (verbatim or trimmed) + suffix.
    """
    chat = rollout.to_chat()
    fast = _segments_from_cache(rollout, tokenizer, chat, cache)
    if fast is not None:
        return fast
    out = []
    prev = ""
    for i in range(len(chat)):
        full = _render(tokenizer, chat[: i + 1], rollout, False)
        if not full.startswith(prev):
            raise ValueError(
                f"the chat template is not prefix-stable at message {i} ({chat[i]['role']}): rendering "
                "messages[:i+1] does not extend the rendering of messages[:i], so per-message token masks "
                "cannot be derived. Use a template that renders earlier turns unchanged."
            )
        seg = full[len(prev):]
        key = _shape_key(chat, i)
        split = _split_with(seg, cache.get(key), chat[i]["content"])
        if split is None:
            probe = _render(tokenizer, chat[:i] + [dict(chat[i], content=_SENTINEL)], rollout, False)
            if not probe.startswith(prev) or probe.count(_SENTINEL) != 1:
                raise ValueError(f"the chat template renders message {i} ({chat[i]['role']}) inconsistently")
            head, tail = probe[len(prev):].split(_SENTINEL)
            if not (seg.startswith(head) and seg.endswith(tail) and len(seg) >= len(head) + len(tail)):
                raise ValueError(f"the chat template renders message {i} ({chat[i]['role']}) inconsistently")
            cache[key] = (head, tail)
            split = (head, seg[len(head): len(seg) - len(tail)], tail)
        msg = rollout[i]
        if msg.type is MessageType.MODEL and msg.token_ids is not None and i > 0:
            _check_generation_header(tokenizer, chat, rollout, i, prev, split[0], cache)
        out.append(split)
        prev = full
    return out


def _segments_from_cache(rollout, tokenizer, chat, cache) -> list[tuple[str, str, str]] | None:
    """One render of the whole conversation, split by cached per-shape header/suffix pairs.

    Accepted only when the render is exactly the concatenation of every
    message's cached header + content + suffix (each learned from a prefix
    render where that shape came last) and every sampled turn's generation
    header was checked: otherwise None, and the incremental path runs.
    """
    pairs = [cache.get(_shape_key(chat, i)) for i in range(len(chat))]
    if not chat or any(p is None for p in pairs):
        return None
    for i, (msg, (head, _)) in enumerate(zip(rollout, pairs, strict=True)):
        if msg.type is MessageType.MODEL and msg.token_ids is not None and i > 0:
            if ("generation-header", head) not in cache:
                return None
    full = _render(tokenizer, chat, rollout, False)
    out, pos = [], 0
    for turn, (head, tail) in zip(chat, pairs, strict=True):
        for rendered in (turn["content"], turn["content"].strip()):
            piece = head + rendered + tail
            if full.startswith(piece, pos):
                out.append((head, rendered, tail))
                pos += len(piece)
                break
        else:
            return None
    return out if pos == len(full) else None


def _split_with(seg: str, head_tail: tuple[str, str] | None, content: str) -> tuple[str, str, str] | None:
    if head_tail is None:
        return None
    head, tail = head_tail
    for rendered in (content, content.strip()):
        if len(seg) == len(head) + len(rendered) + len(tail) and seg == head + rendered + tail:
            return head, rendered, tail
    return None


def _check_generation_header(tokenizer, chat, rollout, i, prev, head, cache) -> None:
    """Sampled ids sit after the generation prompt's header: it must be the history's header."""
    key = ("generation-header", head)
    if key in cache:
        return
    gen_head = _render(tokenizer, chat[:i], rollout, True)[len(prev):]
    if gen_head != head:
        raise ValueError(
            f"message {i}: the template's generation prompt {gen_head!r} differs from the header "
            f"{head!r} it renders for the same turn in history, so sampled token ids cannot be placed"
        )
    cache[key] = True


def _options_key(rollout: Rollout) -> str:
    return repr((rollout.metadata.get("tools"), rollout.metadata.get("chat_template_kwargs")))


def _generation_header(rollout: Rollout, tokenizer) -> str:
    chat = rollout.to_chat()
    with_prompt = _render(tokenizer, chat, rollout, True)
    base = _render(tokenizer, chat, rollout, False)
    if not with_prompt.startswith(base):
        raise ValueError("the chat template's generation prompt does not extend the conversation text")
    return with_prompt[len(base):]


class _Builder:
    """Accumulates ids, mask and log-probs for one rollout."""

    def __init__(self):
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.any_logprobs = False

    def add(self, ids, trainable: bool, logprobs=None):
        self.ids.extend(ids)
        self.mask.extend([int(trainable)] * len(ids))
        if logprobs is None:
            self.logprobs.extend([NAN] * len(ids))
        else:
            self.logprobs.extend(logprobs)
            self.any_logprobs = True


def _tokenize_all(tokenizer, texts: list[str]) -> list[list[int]]:
    """Tokenize many text pieces at once: each distinct piece once, in one batched call.

    Headers and suffixes repeat across messages, so deduplication saves most of the work;
    a fast tokenizer's Rust backend encodes the batch without the Python wrapper's overhead.
    """
    unique = [t for t in dict.fromkeys(texts) if t]
    if not unique:
        return [[] for _ in texts]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        encoded = [e.ids for e in backend.encode_batch(unique, add_special_tokens=False)]
    else:
        encoded = tokenizer(unique, add_special_tokens=False)["input_ids"]
    table = dict(zip(unique, encoded, strict=True))
    return [table[t] if t else [] for t in texts]


def _check_sampled(msg: Message, index: int) -> None:
    if msg.token_ids is not None and msg.type is not MessageType.MODEL:
        raise ValueError(f"message {index} is a {msg.type.name} message with token_ids; only MODEL turns are sampled")


def _plan(rollout: Rollout, tokenizer, cache: dict) -> list[tuple]:
    """Text pieces to tokenize for one rollout: (kind, payload) in order."""
    plan = []
    if has_chat_template(tokenizer):
        segments = _segments_with_template(rollout, tokenizer, cache)
        for i, (msg, (head, content, tail)) in enumerate(zip(rollout, segments, strict=True)):
            _check_sampled(msg, i)
            plan.append(("templated", msg, head, content, tail))
    else:
        for i, msg in enumerate(rollout):
            _check_sampled(msg, i)
            plan.append(("plain", msg, msg.content))
    return plan


def _special_ids(tokenizer) -> set[int]:
    return set(tokenizer.all_special_ids)


def _build(plan, pieces: list[list[int]], tokenizer, specials: set[int]) -> _Builder:
    b = _Builder()
    it = iter(pieces)
    for step in plan:
        if step[0] == "templated":
            _, msg, _head, _content, _tail = step
            head_ids, content_ids, tail_ids = next(it), next(it), next(it)
            train = msg.is_trainable
            eot = tail_ids[:1] if tail_ids and tail_ids[0] in specials else []
            b.add(head_ids, False)
            if msg.token_ids is not None:
                sampled = msg.token_ids
                b.add(sampled, train, msg.logprobs)
                if eot and sampled and sampled[-1] == eot[0]:
                    eot = []  # the model sampled the end-of-turn token itself: never add it twice
                    tail_ids = tail_ids[1:]
                else:  # an end-of-turn the model did not sample is context, not a trained action
                    b.add(eot, False)
            else:
                b.add(content_ids, train)
                b.add(eot, train)
            b.add(tail_ids[len(eot):], False)
        else:
            _, msg, _content = step
            content_ids = next(it)
            train = msg.is_trainable
            if msg.token_ids is not None:
                b.add(msg.token_ids, train, msg.logprobs)
            else:
                b.add(content_ids, train)
                if msg.type is MessageType.MODEL and tokenizer.eos_token_id is not None:
                    b.add([tokenizer.eos_token_id], train)
    return b


def _texts(plan) -> list[str]:
    texts = []
    for step in plan:
        if step[0] == "templated":
            _, msg, head, content, tail = step
            texts += [head, "" if msg.token_ids is not None else content, tail]
        else:
            _, msg, content = step
            texts.append("" if msg.token_ids is not None else content)
    return texts


def _sampling_temperature(rollout: Rollout) -> float | None:
    temps = {m.temperature for m in rollout if m.logprobs is not None and m.temperature is not None}
    if len(temps) > 1:
        raise ValueError(f"rollout mixes sampling temperatures {sorted(temps)}; log-probs would not be comparable")
    return temps.pop() if temps else None


def _finish(b: _Builder, rollout: Rollout, max_length: int | None, truncate: bool, index: int | None):
    n = len(b.ids)
    if max_length is not None and n > max_length:
        if not truncate:
            where = "" if index is None else f" (rollout {index})"
            raise ValueError(
                f"rollout{where} encodes to {n} tokens, over max_length={max_length}; "
                "pass truncate=True to cut it, or raise max_length"
            )
        b.ids, b.mask, b.logprobs = b.ids[:max_length], b.mask[:max_length], b.logprobs[:max_length]
    return EncodedRollout(
        input_ids=b.ids, loss_mask=b.mask, old_logprobs=b.logprobs if b.any_logprobs else None,
        sampling_temperature=_sampling_temperature(rollout),
    )


def encode_rollouts(rollouts: list[Rollout], tokenizer, max_length: int | None = None,
                    truncate: bool = False) -> list[EncodedRollout]:
    """Encode many rollouts with one batched tokenizer call (see `encode_rollout`)."""
    for i, r in enumerate(rollouts):
        if not isinstance(r, Rollout):
            raise TypeError(f"rollout {i} is a {type(r).__name__}, not a Rollout")
    caches: dict[str, dict] = {}  # header/suffix splits, per template options
    plans = [_plan(r, tokenizer, caches.setdefault(_options_key(r), {})) for r in rollouts]
    texts = [_texts(p) for p in plans]
    flat = _tokenize_all(tokenizer, [t for ts in texts for t in ts])
    specials = _special_ids(tokenizer)
    out, start = [], 0
    for i, (r, plan, ts) in enumerate(zip(rollouts, plans, texts, strict=True)):
        pieces = flat[start: start + len(ts)]
        start += len(ts)
        b = _build(plan, pieces, tokenizer, specials)
        out.append(_finish(b, r, max_length, truncate, i if len(rollouts) > 1 else None))
    return out


def encode_rollout(rollout: Rollout, tokenizer, max_length: int | None = None,
                   truncate: bool = False) -> EncodedRollout:
    """Token ids, loss mask (1 = trained) and sampled log-probs of one rollout.

    Over `max_length` tokens raises ValueError unless `truncate=True` (then
    the tail is cut). With a chat template, `tokenizer.decode(input_ids)`
    equals `apply_chat_template(rollout.to_chat(), tokenize=False)` whenever
    the sampled ids decode to the message text.
    """
    return encode_rollouts([rollout], tokenizer, max_length, truncate)[0]


def encode_prompt(rollout: Rollout, tokenizer) -> list[int]:
    """The ids a generator conditions on for the next MODEL turn.

    The rollout's own encoding plus the template's generation header
    (e.g. `<|im_start|>assistant\\n`); plain concatenation without a template.
    """
    ids = encode_rollout(rollout, tokenizer).input_ids if len(rollout) else []
    if has_chat_template(tokenizer):
        header = _generation_header(rollout, tokenizer)
        if header:
            ids = ids + tokenizer(header, add_special_tokens=False)["input_ids"]
    return ids


def collate(encoded: list[EncodedRollout], pad_token_id: int, pad_to_multiple_of: int | None = None) -> Batch:
    """Right-pad encoded rollouts into a `Batch` of (B, T) tensors."""
    if not encoded:
        raise ValueError("collate needs at least one encoded rollout")
    if pad_token_id is None:
        raise ValueError("collate needs a pad_token_id (set tokenizer.pad_token, e.g. to the eos token)")
    for i, e in enumerate(encoded):
        if len(e) == 0:
            raise ValueError(f"encoded rollout {i} is empty")
    T = max(len(e) for e in encoded)
    if pad_to_multiple_of:
        T = math.ceil(T / pad_to_multiple_of) * pad_to_multiple_of
    B = len(encoded)
    input_ids = torch.full((B, T), pad_token_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((B, T), dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros((B, T), dtype=torch.long)  # (B, T)
    any_lp = any(e.old_logprobs is not None for e in encoded)
    old = torch.full((B, T), NAN, dtype=torch.float32) if any_lp else None  # (B, T)
    for i, e in enumerate(encoded):
        n = len(e)
        input_ids[i, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(e.loss_mask, dtype=torch.long)
        if old is not None and e.old_logprobs is not None:
            old[i, :n] = torch.tensor(e.old_logprobs, dtype=torch.float32)
    temps = {e.sampling_temperature for e in encoded if e.sampling_temperature is not None}
    if len(temps) > 1:
        raise ValueError(f"batch mixes sampling temperatures {sorted(temps)}")
    return Batch(input_ids, attention_mask, loss_mask, old, temps.pop() if temps else None)


def rollouts_to_batch(rollouts: list[Rollout], tokenizer, max_length: int | None = None,
                      truncate: bool = False) -> Batch:
    """`encode_rollouts` then `collate` with the tokenizer's pad id (falls back to eos)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return collate(encode_rollouts(rollouts, tokenizer, max_length, truncate), pad)
