"""Rollout -> token ids, loss mask and sampled log-probs; collate into a `Batch`.

Legend: B batch, T tokens.

Sampled turns are used as sampled (prompts as the generator saw them, then its ids); hand-written ones are
the template's rendering tokenized whole, masked from character offsets (docs/masks_and_templates.md).
The invariant the generator relies on: `encode_prompt(rollout)` followed by the ids it sampled is exactly
a prefix of `encode_rollout(rollout + reply)`. Where exactness cannot hold, a ValueError names the cause.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from SimpleTorchLLMRL.chat.message import MessageType, Rollout, check_ids_decode
from SimpleTorchLLMRL.chat.template import ChatTemplate, chat_template_for
from SimpleTorchLLMRL.chat.truncation import Truncation, batch_truncation

NAN = float("nan")


@dataclass
class EncodedRollout:
    """Token-level view of one rollout. All lists have the same length.

    sampler_logprobs[t] is the sampled log-prob of input_ids[t] (NaN where the token was not sampled by a
    generator); None when no message carries any. message_index[t] is the index of the message whose sampled
    or trained token input_ids[t] is, -1 for template text and untrained messages.
    """

    input_ids: list[int]
    loss_mask: list[int]
    sampler_logprobs: list[float] | None
    sampling_temperature: float | None = None
    message_index: list[int] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class Batch:
    """Right-padded tensors, shape (B, T).

    input_ids      long  token ids (pad_token_id where padded)
    attention_mask long  1 on real tokens
    loss_mask      long  1 on trainable tokens
    sampler_logprobs float the generator's log-prob of input_ids[:, t], NaN where unknown; None if no rollout has any
    message_index  long  the message a sampled / trained token belongs to, -1 elsewhere (None if not known)
    truncation     the top-k / top-p / min-p of the sampled tokens drawn from a truncated distribution
                   (`chat.truncation.Truncation`, (B, T)); None when no token was (`rollouts_to_batch` sets it)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    sampler_logprobs: torch.Tensor | None = None
    sampling_temperature: float | None = None
    message_index: torch.Tensor | None = None
    truncation: Truncation | None = None

    def _map(self, fn) -> Batch:
        keep = lambda t: None if t is None else fn(t)  # noqa: E731
        return Batch(fn(self.input_ids), fn(self.attention_mask), fn(self.loss_mask), keep(self.sampler_logprobs),
                     self.sampling_temperature, keep(self.message_index),
                     None if self.truncation is None else self.truncation.map(fn))

    def to(self, device) -> Batch:
        return self._map(lambda t: t.to(device))

    def __getitem__(self, index) -> Batch:
        """Select rows (an int, slice or index tensor), e.g. for micro-batching."""
        if isinstance(index, int):
            index = slice(index, index + 1)
        return self._map(lambda t: t[index])

    def columns(self, T: int) -> Batch:
        """The first T columns (e.g. trimmed of all-padding columns)."""
        return self._map(lambda t: t[:, :T])

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


# ---------------------------------------------------------------------- plan: text pieces and sampled ids


@dataclass
class _Text:
    """Text to tokenize whole. Its first `skip` characters are an anchor token whose ids are dropped.

    spans: (message index, start, end) character spans whose tokens are trained.
    """

    text: str
    skip: int = 0
    spans: tuple = ()


@dataclass
class _Ids:
    """Ids used verbatim: a sampled turn (with its log-probs) or an EOS token."""

    ids: list[int]
    index: int
    trained: bool
    logprobs: list[float] | None = None


def _template(rollout: Rollout, tokenizer) -> ChatTemplate:
    return chat_template_for(tokenizer, rollout.metadata.get("tools"), rollout.metadata.get("chat_template_kwargs"))


def _plan(rollout: Rollout, tokenizer, for_prompt: bool) -> list:
    for i, m in enumerate(rollout):
        if m.token_ids is not None and m.type is not MessageType.MODEL:
            raise ValueError(f"message {i} is a {m.type.name} message with token_ids; only MODEL turns are sampled")
    if not has_chat_template(tokenizer):
        return _plain_plan(rollout, tokenizer)
    ct = _template(rollout, tokenizer)
    chat = rollout.to_chat()
    sampled = [i for i, m in enumerate(rollout) if m.token_ids is not None]
    plan: list = []
    start, prev = 0, None
    for s in sampled + [len(chat)]:
        last = s == len(chat)
        gen = for_prompt if last else True
        # a prompt needs no mask: only training encodings locate trainable messages
        trainable = [] if for_prompt else [j for j in range(start, s) if rollout[j].is_trainable]
        if prev is None and (s > 0 or gen):
            text = ct.render(chat[:s], gen)
            ct.check_rendered(chat[:s], text, gen)
            plan.append(_Text(text, 0, tuple(ct.spans(chat[:s], trainable, text, gen))))
        elif prev is not None and (s > start or gen):
            ended = bool(rollout[prev].token_ids) and rollout[prev].token_ids[-1] in ct.turn_end_ids
            text, spans = ct.continuation(chat[prev], chat[start:s], gen, ended, [j - start for j in trainable],
                                          start)
            anchor = ct.anchor
            plan.append(_Text(anchor + text, len(anchor),
                              tuple((start + j, a + len(anchor), b + len(anchor)) for j, a, b in spans)))
        if not last:
            msg = rollout[s]
            plan.append(_Ids(msg.token_ids, s, msg.is_trainable, msg.logprobs))
            start, prev = s + 1, s
    return plan


def _plain_plan(rollout: Rollout, tokenizer) -> list:
    plan: list = []
    for i, msg in enumerate(rollout):
        if msg.token_ids is not None:
            plan.append(_Ids(msg.token_ids, i, msg.is_trainable, msg.logprobs))
            continue
        train = msg.is_trainable
        plan.append(_Text(msg.content, 0, ((i, 0, len(msg.content)),) if train else ()))
        if msg.type is MessageType.MODEL and tokenizer.eos_token_id is not None:
            plan.append(_Ids([tokenizer.eos_token_id], i, train))
    return plan


# ---------------------------------------------------------------------- tokenize pieces, masks from offsets


def _encode_texts(tokenizer, texts: list[str]) -> dict:
    """Each distinct text once, in one batched call: a `tokenizers.Encoding` (ids and character offsets),
    or a plain id list without a fast backend."""
    unique = [t for t in dict.fromkeys(texts) if t]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return dict(zip(unique, backend.encode_batch(unique, add_special_tokens=False), strict=True))
    ids = tokenizer(unique, add_special_tokens=False)["input_ids"] if unique else []
    return dict(zip(unique, ids, strict=True))


def _straddle(text: str, s: int, e: int, i: int, a: int, b: int) -> str | None:
    """Why the token at [s, e) cannot be trained as part of message i's span [a, b); None if it can.

    Template whitespace may ride on the message's first or last word (SentencePiece's '▁The' after
    '[/INST] '). A token whose share of the span is only whitespace merges template text with the
    message's leading or trailing whitespace (Qwen's header '\n' + content '\n\n' = one '\n\n\n'):
    training it would train template text, and leaving it out would drop the message's text.
    """
    outside = text[s:a] + text[b:e]
    where = f"(in {text[max(0, s - 20): e + 20]!r})"
    if outside.strip():
        return (f"the token covering {text[s:e]!r} spans both message {i}'s trained text and other text {where}, "
                "so its loss mask cannot be exact")
    inside = text[max(s, a): min(e, b)]
    if not outside or inside.strip():
        return None
    edge = "leading" if s < a else "trailing"
    return (f"message {i}: the tokenizer merges the chat template's text {outside!r} with the message's {edge} "
            f"whitespace {inside!r} into one token {text[s:e]!r} {where}, so no loss mask covers exactly the "
            f"message's tokens; strip the {edge} whitespace from the message, or train the turn as sampled "
            "(`as_sampled(rollout, tokenizer)`, or token_ids on the message)")


def _owners(piece: _Text, offsets: list[tuple[int, int]]) -> list[int]:
    """Per token: the message index of the trained span it falls in, -1 outside; raises on a straddling token."""
    text, out = piece.text, []
    for s, e in offsets:
        owner = -1
        for i, a, b in piece.spans:
            if s < b and e > a:
                why = (f"the token covering {text[s:e]!r} spans both message {owner}'s and message {i}'s trained "
                       "text, so its loss mask cannot be exact") if owner >= 0 else _straddle(text, s, e, i, a, b)
                if why:
                    raise ValueError(why)
                owner = i
        out.append(owner)
    return out


def _piecewise(tokenizer, piece: _Text) -> tuple[list[int], list[int]]:
    """Without offsets: tokenize between span edges and accept only if that equals the whole text's ids."""
    cuts = sorted({piece.skip, len(piece.text)} | {x for _, a, b in piece.spans for x in (a, b)})
    whole = tokenizer(piece.text, add_special_tokens=False)["input_ids"]
    head = tokenizer(piece.text[: piece.skip], add_special_tokens=False)["input_ids"] if piece.skip else []
    ids, owners = list(head), [-1] * len(head)
    for a, b in zip(cuts, cuts[1:], strict=False):
        part = tokenizer(piece.text[a:b], add_special_tokens=False)["input_ids"]
        owner = next((i for i, x, y in piece.spans if x <= a and b <= y), -1)
        ids += part
        owners += [owner] * len(part)
    if ids != whole:
        raise ValueError("this tokenizer has no character offsets and tokenizes the template's pieces differently "
                         "from its whole text, so exact masks cannot be derived; use a fast tokenizer")
    return ids[len(head):], owners[len(head):]


def _piece_ids(tokenizer, piece: _Text, encoded) -> tuple[list[int], list[int]]:
    """(ids, owner per id) of a text piece, the anchor's ids dropped."""
    if not piece.text:
        return [], []
    enc = encoded[piece.text]
    if isinstance(enc, list):  # no fast backend: no offsets
        if not piece.spans and not piece.skip:
            return list(enc), [-1] * len(enc)
        return _piecewise(tokenizer, piece)
    ids = enc.ids
    if len(piece.spans) == 1 and piece.spans[0][1:] == (0, len(piece.text)) and not piece.skip:
        return ids, [piece.spans[0][0]] * len(ids)  # the whole text is one trained message (no template)
    if not piece.spans and not piece.skip:
        return ids, [-1] * len(ids)
    offsets = enc.offsets
    drop = 0
    while drop < len(offsets) and offsets[drop][1] <= piece.skip:
        drop += 1
    if drop < len(offsets) and offsets[drop][0] < piece.skip:
        raise ValueError(f"the tokenizer merges the anchor {piece.text[: piece.skip]!r} with the text after it")
    owners = _owners(piece, offsets[drop:]) if piece.spans else [-1] * (len(ids) - drop)
    return ids[drop:], owners


# ---------------------------------------------------------------------- assemble


def _sampling_temperature(rollout: Rollout) -> float | None:
    temps = {m.temperature for m in rollout if m.logprobs is not None and m.temperature is not None}
    if len(temps) > 1:
        raise ValueError(f"rollout mixes sampling temperatures {sorted(temps)}; log-probs would not be comparable")
    return temps.pop() if temps else None


def _assemble(plan: list, tokenizer, encoded) -> EncodedRollout:
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    index: list[int] = []
    any_logprobs = False
    for piece in plan:
        if isinstance(piece, _Ids):
            n = len(piece.ids)
            ids += piece.ids
            mask += [int(piece.trained)] * n
            index += [piece.index] * n
            logprobs += piece.logprobs if piece.logprobs is not None else [NAN] * n
            any_logprobs |= piece.logprobs is not None
        else:
            part, owners = _piece_ids(tokenizer, piece, encoded)
            ids += part
            mask += [int(o >= 0) for o in owners]
            index += owners
            logprobs += [NAN] * len(part)
    return EncodedRollout(ids, mask, logprobs if any_logprobs else None, None, index)


def _finish(enc: EncodedRollout, rollout: Rollout, max_length: int | None, truncate: bool,
            index: int | None) -> EncodedRollout:
    n = len(enc)
    if max_length is not None and n > max_length:
        if not truncate:
            where = "" if index is None else f" (rollout {index})"
            raise ValueError(
                f"rollout{where} encodes to {n} tokens, over max_length={max_length}; "
                "pass truncate=True to cut it, or raise max_length"
            )
        cut = lambda xs: None if xs is None else xs[:max_length]  # noqa: E731
        enc = EncodedRollout(cut(enc.input_ids), cut(enc.loss_mask), cut(enc.sampler_logprobs), None,
                             cut(enc.message_index))
    enc.sampling_temperature = _sampling_temperature(rollout)
    return enc


def _encode(rollouts: list[Rollout], tokenizer, for_prompt: bool) -> list[EncodedRollout]:
    for i, r in enumerate(rollouts):
        if not isinstance(r, Rollout):
            raise TypeError(f"rollout {i} is a {type(r).__name__}, not a Rollout")
    plans = [_plan(r, tokenizer, for_prompt) for r in rollouts]
    encoded = _encode_texts(tokenizer, [p.text for plan in plans for p in plan if isinstance(p, _Text)])
    return [_assemble(plan, tokenizer, encoded) for plan in plans]


def encode_rollouts(rollouts: list[Rollout], tokenizer, max_length: int | None = None,
                    truncate: bool = False, *, check_ids: bool = True) -> list[EncodedRollout]:
    """Encode many rollouts with one batched tokenizer call (see `encode_rollout`)."""
    if check_ids:
        check_ids_decode(list(rollouts), tokenizer)
    out = _encode(list(rollouts), tokenizer, for_prompt=False)
    many = len(out) > 1
    return [_finish(e, r, max_length, truncate, i if many else None)
            for i, (e, r) in enumerate(zip(out, rollouts, strict=True))]


def encode_rollout(rollout: Rollout, tokenizer, max_length: int | None = None,
                   truncate: bool = False, *, check_ids: bool = True) -> EncodedRollout:
    """Token ids, loss mask (1 = trained), sampled log-probs and message index of one rollout.

    Over `max_length` tokens: ValueError unless `truncate=True` (the tail is cut). A MODEL turn whose
    token_ids do not decode to its content is a ValueError (`check_ids_decode`) unless `check_ids=False`.
    """
    return encode_rollouts([rollout], tokenizer, max_length, truncate, check_ids=check_ids)[0]


def encode_prompt(rollout: Rollout, tokenizer) -> list[int]:
    """The ids a generator conditions on for the next MODEL turn.

    With a template: the rollout as sampled so far plus the template's rendering of the messages since the
    last sampled turn and the generation prompt (for a rollout without sampled turns,
    `apply_chat_template(..., add_generation_prompt=True)`). Plain concatenation without a template.
    """
    return _encode([rollout], tokenizer, for_prompt=True)[0].input_ids


def as_sampled(rollout: Rollout, tokenizer) -> Rollout:
    """A copy whose hand-written MODEL turns carry ids as a model would sample them.

    Each MODEL message without `token_ids` gets its content tokenized on its own
    followed by the template's end-of-turn token (EOS without a template), so a
    supervised warm-up sees exactly the encoding RL will use: prompts as the
    generator renders them, replies as sampled ids. No log-probs are attached.
    """
    if has_chat_template(tokenizer):
        ct = _template(rollout, tokenizer)
        end = tokenizer.convert_tokens_to_ids(ct.end_of_turn[0]) if ct.end_of_turn else tokenizer.eos_token_id
    else:
        end = tokenizer.eos_token_id
    out = rollout.copy()
    for m in out:
        if m.type is MessageType.MODEL and m.token_ids is None:
            m.token_ids = tokenizer(m.content, add_special_tokens=False)["input_ids"] + ([end] if end is not None else [])
    return out


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
    lengths = torch.tensor([len(e) for e in encoded])  # (B,)
    attention_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # (B, T)
    real = attention_mask.bool()

    total = int(lengths.sum())

    def field(values, fill, dtype):  # rows' lists -> one flat array scattered into (B, T), row-major
        out = torch.full((B, T), fill, dtype=dtype)
        flat = np.fromiter(itertools.chain.from_iterable(values), np.float32 if dtype == torch.float32 else np.int64,
                           total)
        out[real] = torch.from_numpy(flat)
        return out

    input_ids = field((e.input_ids for e in encoded), pad_token_id, torch.long)  # (B, T)
    loss_mask = field((e.loss_mask for e in encoded), 0, torch.long)  # (B, T)
    old = None
    if any(e.sampler_logprobs is not None for e in encoded):
        old = field((e.sampler_logprobs if e.sampler_logprobs is not None else [NAN] * len(e) for e in encoded),
                    NAN, torch.float32)  # (B, T)
    index = None
    if all(e.message_index is not None for e in encoded):
        index = field((e.message_index for e in encoded), -1, torch.long)  # (B, T)
    temps = {e.sampling_temperature for e in encoded if e.sampling_temperature is not None}
    if len(temps) > 1:
        raise ValueError(f"batch mixes sampling temperatures {sorted(temps)}")
    return Batch(input_ids, attention_mask, loss_mask, old, temps.pop() if temps else None, index)


def rollouts_to_batch(rollouts: list[Rollout], tokenizer, max_length: int | None = None,
                      truncate: bool = False, *, check_ids: bool = True) -> Batch:
    """`encode_rollouts` then `collate` with the tokenizer's pad id (falls back to eos), with the
    `truncation` of the tokens sampled from a top-k / top-p / min-p distribution."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = collate(encode_rollouts(rollouts, tokenizer, max_length, truncate, check_ids=check_ids), pad)
    if any(m.sampling for r in rollouts for m in r):  # a turn drawn from a changed distribution (else: none)
        batch.truncation = batch_truncation(rollouts, batch.message_index, batch.sampler_logprobs)
    return batch
