"""What the backends and the generator share: `SamplingConfig`, `Sample`, stop-string cutting, the `Backend`
protocol and `DecodeWatch`. Nothing here imports a backend.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from SimpleTorchLLMRL.chat.truncation import truncation_settings


class Backend(Protocol):
    """What callers use of a backend (HF `generate` or vLLM): `ModelGenerate` and the gateway read a backend
    only through these names, never by asking whether an attribute exists."""

    mixed_adapters: bool
    """True when one `generate` call serves prompts of several adapters (`adapter=` a list, one per prompt);
    False: the generator makes one call per adapter."""

    supports_top_logprobs: bool
    """True when `top_logprobs` can score the k most likely ids at each sampled position."""

    def check_sampling(self, sampling: SamplingConfig) -> None:
        """Raise ValueError, before anything is sampled, when this backend cannot record the log-probs of a
        call with `sampling` (vLLM: its engine's log-probs mode); the HF backend records any settings."""
        ...

    def prepare_grammar(self, grammar: str) -> None:
        """Ahead of a call, on the caller's thread: compile `grammar` (EBNF) for this model (HF; vLLM only checks
        it parses, its engine compiles), so the call does not compile it on the generating thread."""
        ...

    def top_logprobs(self, prompt_ids: list[int], token_ids: list[int], temperature: float,
                     k: int) -> list[list[tuple[int, float]]]:
        """At each of `token_ids`' positions after `prompt_ids`: the k most likely (id, log-prob) pairs under
        logits / temperature. Raises ValueError where `supports_top_logprobs` is False."""
        ...

    @property
    def logprob_temperature(self) -> float:
        """The temperature the generator's default settings record log-probs under."""
        ...

    def logprob_temperature_for(self, sampling: SamplingConfig) -> float:
        """The temperature a call with `sampling` records its log-probs under."""
        ...

    @property
    def max_context(self) -> int | None: ...

    def generate(self, prompts: list[list[int]], n: int, seeds: list[int], *,
                 sampling: SamplingConfig) -> list[list[Sample]]:
        """`n` Samples per prompt under `sampling`, this call's settings (a backend reads none of its own).
        seeds: one per prompt; sample j of prompt i draws from the stream of (seeds[i], j) alone, the same in
        any batch. Backends with LoRA adapters also take `adapter=` (a name; a list, one per prompt, where
        `mixed_adapters`), and `watch=` (a `DecodeWatch`); each only passed when set."""
        ...

    def push_weights(self, model, mode: str = "merged") -> None:
        """Backends with adapters also take `adapter=` (names to push, with mode "adapter"); only passed when set."""
        ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...


@dataclass
class SamplingConfig:
    """What to sample and when to stop; validated on construction. What logit_bias, the penalties, min_p
    and grammar do, and which log-probs each records: docs/generation.md."""

    max_new_tokens: int = 50
    temperature: float = 0.7
    do_sample: bool = True
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    tool_call_stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = field(default=())
    logit_bias: tuple[tuple[int, float], ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    grammar: str | None = None
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be None or in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be None or an int >= 0 (0 disables), got {self.top_k!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1] (0 disables), got {self.min_p!r}")
        self.min_p = float(self.min_p)
        self.stop = _as_strings("stop", self.stop)
        self.tool_call_stop = _as_strings("tool_call_stop", self.tool_call_stop)
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids or ())  # empty: the generator fills in its own
        self.logit_bias = _as_bias(self.logit_bias)
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2] (OpenAI's range; 0 disables), got {value!r}")
            setattr(self, name, float(value))
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError(f"grammar must be None or EBNF text with a `root` rule, got {self.grammar!r:.80}")
            from SimpleTorchLLMRL.model.generation.constrain import check_grammar

            check_grammar(self.grammar)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature the recorded log-probs are under."""
        return float(self.temperature) if self.temperature > 0 else 1.0

    @property
    def all_stops(self) -> tuple[str, ...]:
        """The stop strings that end a completion: none under a grammar (it ends where the grammar does)."""
        if self.grammar is not None:
            return ()
        return tuple(dict.fromkeys(self.stop + self.tool_call_stop))

    @property
    def truncates(self) -> bool:
        """Whether top-k / top-p / min-p cut the sampling distribution."""
        return bool(self.top_k) or (self.top_p is not None and self.top_p < 1) or self.min_p > 0

    @property
    def records_truncated(self) -> bool:
        """Whether the recorded log-probs are under the truncated distribution: the trainer's rule,
        `chat.truncation.truncation_settings` of `distribution_changes()`."""
        if not self.truncates or self.greedy:
            return False
        return truncation_settings(self.distribution_changes()) is not None

    @property
    def penalizes(self) -> bool:
        """Whether frequency / presence penalties apply (they need the counts of the tokens sampled so far)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def shifts_logits(self) -> bool:
        """Whether logit_bias or a penalty moves the logits the draw is made from."""
        return bool(self.logit_bias) or self.penalizes

    def distribution_changes(self) -> dict | None:
        """The settings beyond temperature that made the distribution differ from softmax(raw logits / T),
        recorded as `Message.sampling` (None: nothing did; JSON-ready). Keys, those set: "top_k", "top_p",
        "min_p" (not when greedy), "logit_bias" ({str(id): bias}, as OpenAI sends it), the penalties, "grammar"."""
        out: dict = {}
        if not self.greedy:
            if self.top_k:
                out["top_k"] = int(self.top_k)
            if self.top_p is not None and self.top_p < 1:
                out["top_p"] = float(self.top_p)
            if self.min_p > 0:
                out["min_p"] = self.min_p
        if self.logit_bias:
            out["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        if self.frequency_penalty:
            out["frequency_penalty"] = self.frequency_penalty
        if self.presence_penalty:
            out["presence_penalty"] = self.presence_penalty
        if self.grammar is not None:
            out["grammar"] = self.grammar
        return out or None

    def check_vocabulary(self, vocab_size: int | None) -> None:
        """Raise a ValueError naming a logit_bias id the model does not score (ids in [0, vocab_size))."""
        if vocab_size is None:
            return
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias names token id {bad[0]}, outside this model's vocabulary of {vocab_size} "
                             f"ids [0, {vocab_size})")


def _as_bias(value) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (id, bias) pairs: ids ints >= 0 (or their decimal strings), biases finite numbers
    (zero biases dropped)."""
    if value is None:
        return ()
    pairs = value.items() if isinstance(value, Mapping) else value
    out: dict[int, float] = {}
    try:
        pairs = list(pairs)
    except TypeError:
        raise ValueError(f"logit_bias must be a dict of token id -> bias (or (id, bias) pairs), got {value!r}") from None
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"logit_bias must be a dict of token id -> bias (or (id, bias) pairs), got {value!r}")
        tok, bias = pair
        if isinstance(tok, str) and tok.isascii() and tok.isdigit():
            tok = int(tok)
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {tok!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(f"logit_bias[{tok}] must be a finite number, got {bias!r}")
        if tok in out:
            raise ValueError(f"logit_bias names token id {tok} twice")
        out[tok] = float(bias)
    return tuple(sorted((t, b) for t, b in out.items() if b != 0))  # a zero bias changes nothing


def _as_strings(name: str, value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    value = tuple(value)
    if any(not isinstance(s, str) or not s for s in value):
        raise ValueError(f"{name} must be a string or a list of non-empty strings, got {value!r}")
    return value


@dataclass
class Sample:
    """One completion, already cut at its end."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str


def stop_window(stops: Sequence[str]) -> int:
    """Tokens to decode so that any stop string ending at the last token is visible (>= 1 byte per token)."""
    return max(len(s.encode("utf-8")) for s in stops) + 3


def find_stop(tokenizer, ids: Sequence[int], stops: Sequence[str], window: int) -> str | None:
    """The stop string that the decoded tail of `ids` contains (earliest-ending wins), or None."""
    tail = tokenizer.decode(list(ids[-window:]), skip_special_tokens=True)
    best, best_end = None, None
    for s in stops:
        at = tail.find(s)
        if at >= 0 and (best_end is None or at + len(s) < best_end):
            best, best_end = s, at + len(s)
    return best


def text_through_stop(text: str, stops: Sequence[str]) -> str:
    """`text` cut right after the earliest-ending stop string it contains."""
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return text[: min(ends)] if ends else text


def cut_sample(tokenizer, ids: list[int], logprobs: list[float], cfg: SamplingConfig) -> Sample:
    """Cut a raw continuation at its first EOS id or stop string (both kept); never keep padding."""
    eos = set(cfg.eos_token_ids)
    stops = cfg.all_stops
    window = stop_window(stops) if stops else 0
    for k, tok in enumerate(ids):
        if tok in eos:
            return _sample(tokenizer, ids[: k + 1], logprobs[: k + 1], "stop", None)
        hit = find_stop(tokenizer, ids[: k + 1], stops, window) if stops else None
        if hit is not None:
            reason = "tool_call" if hit in cfg.tool_call_stop else "stop"
            return _sample(tokenizer, ids[: k + 1], logprobs[: k + 1], reason, stops)
    return _sample(tokenizer, ids[: cfg.max_new_tokens], logprobs[: cfg.max_new_tokens], "length", None)


def clamp_logprob(x) -> float:
    """A sampled token's log-prob, rounding noise above 0 clamped to 0; NaN stays NaN (so `Message` refuses it:
    `min(0.0, nan)` is 0.0, which would train a broken model's turn as certain)."""
    x = float(x)
    return x if x != x else min(0.0, x)


def _sample(tokenizer, ids, logprobs, reason, stops) -> Sample:
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if stops:
        text = text_through_stop(text, stops)
    return Sample(list(ids), [clamp_logprob(x) for x in logprobs], reason, text)


def default_eos_ids(tokenizer, model=None) -> tuple[int, ...]:
    """The tokenizer's EOS plus the model's generation-config EOS ids (int or list)."""
    ids = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.extend(int(t) for t in ([gen_eos] if isinstance(gen_eos, int) else gen_eos))
    return tuple(dict.fromkeys(ids))


TokensFn = Callable[[Sequence[int], list[list[int]]], None]


class DecodeWatch:
    """What a decode loop reports while it runs (each row's new ids) and asks (which rows to give up).

        watch = DecodeWatch(on_tokens=lambda rows, ids: ..., cancelled=lambda row: ...)
        generator.generate(rollouts, n, watch=watch)       # row i * n + j: prompt i's j-th sample

    `on_tokens(rows, ids)` runs on the generating thread with each row's raw ids since the last call (HF: how
    often is in docs/gateway.md, "Streaming and hang-ups"; vLLM: per engine step; an ended row keeps
    receiving ids, cut as `cut_sample` does): it must be quick and not raise. `cancelled(row)` is read at
    the same points: such a row stops and keeps what it sampled ("length" unless it had ended); the other
    rows sample the ids they would have without it.
    """

    def __init__(self, on_tokens: TokensFn | None = None, cancelled: Callable[[int], bool] | None = None):
        self._on_tokens, self._cancelled = on_tokens, cancelled
        self.streams = on_tokens is not None  # the fast decode checks more often for a watch that streams
        self._stopped_at: dict[int, int] = {}  # cancelled row -> ids it had sampled when the loop gave it up

    def tokens(self, rows: Sequence[int], ids: list[list[int]]) -> None:
        if self._on_tokens is not None and rows:
            self._on_tokens(rows, ids)

    def is_cancelled(self, row: int) -> bool:
        return self._cancelled is not None and bool(self._cancelled(row))

    def give_up(self, row: int, sampled: int) -> None:
        """The loop stopped decoding `row` (cancelled) after it had sampled `sampled` ids."""
        self._stopped_at.setdefault(row, sampled)

    def given_up_at(self, row: int) -> int | None:
        """How many ids `row` had sampled when the loop gave it up; None when it ran to its end."""
        return self._stopped_at.get(row)

    def select(self, rows: Sequence[int]) -> DecodeWatch:
        """This watch for a sub-call that generates only `rows` (its row r is this call's rows[r])."""
        return _Selected(self, list(rows))


class _Selected(DecodeWatch):
    def __init__(self, parent: DecodeWatch, rows: list[int]):
        super().__init__()
        self.parent, self.rows, self.streams = parent, rows, parent.streams

    def tokens(self, rows: Sequence[int], ids: list[list[int]]) -> None:
        self.parent.tokens([self.rows[r] for r in rows], ids)

    def is_cancelled(self, row: int) -> bool:
        return self.parent.is_cancelled(self.rows[row])

    def give_up(self, row: int, sampled: int) -> None:
        self.parent.give_up(self.rows[row], sampled)

    def given_up_at(self, row: int) -> int | None:
        return self.parent.given_up_at(self.rows[row])
