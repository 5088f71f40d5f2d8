"""What backends share: the sampling config, one sampled completion, stop-string cutting, the backend protocol.

Both backends (`hf_backend`, `vllm`) and the generator (`generate`) import from here;
nothing here imports them, so the model package has no import cycle.

Legend: N new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class Backend(Protocol):
    """What `ModelGenerate` needs from a backend (HF `generate` or vLLM)."""

    @property
    def logprob_temperature(self) -> float:
        """The temperature the generator's default settings record log-probs under."""
        ...

    def logprob_temperature_for(self, sampling: SamplingConfig) -> float:
        """The temperature a call with `sampling` records its log-probs under."""
        ...

    @property
    def max_context(self) -> int | None: ...

    def generate(self, prompts: list[list[int]], n: int, seed: int | None, *,
                 sampling: SamplingConfig) -> list[list[Sample]]:
        """`n` Samples per prompt under `sampling`, this call's settings: a backend reads no sampling
        settings of its own during a call, so calls with other settings never see each other's.
        Backends that serve several LoRA adapters also take `adapter=` (a name; a list of one per
        prompt where `mixed_adapters` is True); it is only passed when set."""
        ...

    def push_weights(self, model, mode: str = "merged") -> None:
        """Backends with adapters also take `adapter=` (names to push, with mode "adapter"); only passed when set."""
        ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...


@dataclass
class SamplingConfig:
    """What to sample and when to stop; validated on construction.

    grammar: text in xgrammar's EBNF dialect (start rule `root`) that every completion must match
    (constrained decoding, `model/constrain.py`; None: unconstrained). Recorded log-probs stay those
    of the raw logits / T, before the grammar's mask; the grammar is the one change to the sampling
    distribution a call with it records (`grammar` itself)."""

    max_new_tokens: int = 50
    temperature: float = 0.7
    do_sample: bool = True
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    tool_call_stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = field(default=())
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be None or in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be None or an int >= 0 (0 disables), got {self.top_k!r}")
        self.stop = _as_strings("stop", self.stop)
        self.tool_call_stop = _as_strings("tool_call_stop", self.tool_call_stop)
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError(f"grammar must be None or EBNF text with a `root` rule, got {self.grammar!r:.80}")
            from SimpleTorchLLMRL.model.constrain import check_grammar

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
        return tuple(dict.fromkeys(self.stop + self.tool_call_stop))

    @property
    def truncates(self) -> bool:
        """Whether top-k / top-p cut the sampling distribution."""
        return bool(self.top_k) or (self.top_p is not None and self.top_p < 1)


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


# ----------------------------------------------------------------------------- end-of-sequence logic


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


def _sample(tokenizer, ids, logprobs, reason, stops) -> Sample:
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if stops:
        text = text_through_stop(text, stops)
    return Sample(list(ids), [min(0.0, float(x)) for x in logprobs], reason, text)


def default_eos_ids(tokenizer, model=None) -> tuple[int, ...]:
    """The tokenizer's EOS plus the model's generation-config EOS ids (int or list)."""
    ids = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.extend(int(t) for t in ([gen_eos] if isinstance(gen_eos, int) else gen_eos))
    return tuple(dict.fromkeys(ids))
