"""Do a rollout's sampled ids hold the text its rewards read? `check_ids_decode` (encode_rollouts calls it)."""

from __future__ import annotations

import unicodedata

from SimpleTorchLLMRL.chat.message import MessageType, Rollout


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
