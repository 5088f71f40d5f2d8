"""Constrained decoding with xgrammar: every completion of a call matches `SamplingConfig.grammar`.

Legend: B rows, V vocab (the model's logits width, which can exceed len(tokenizer)).

    check_grammar(ebnf)                      ValueError naming the grammar when it does not parse
    json_schema_grammar(schema)              a JSON schema (or {"type": "object"}) as EBNF text
    RowMatchers(tokenizer, ebnf, B, eos)     one decode's per-row matchers: `pick(picker, scores)`

The mask changes which token is drawn, never the recorded log-prob (docs/generation.md).
"""

from __future__ import annotations

import functools
import json
import threading
import weakref
from collections import OrderedDict

import torch

MAX_COMPILED = 32  # compiled grammars kept per (tokenizer, V)
MAX_COMPILED_BYTES = 32 * 2**20  # and their bytes together (`CompiledGrammar.memory_size_bytes`)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError("constrained decoding (SamplingConfig.grammar, response_format) needs xgrammar: "
                          "pip install 'SimpleTorchLLMRL[gateway]' (or pip install xgrammar)") from e
    return xgrammar


@functools.lru_cache(maxsize=32)
def check_grammar(grammar: str) -> None:
    """Raise ValueError naming `grammar` when it is not EBNF that xgrammar parses with a `root` rule."""
    xgr = _xgrammar()
    try:
        xgr.Grammar.from_ebnf(grammar)
    except RuntimeError as e:
        raise ValueError(f"grammar {_head(grammar)} does not compile: {_reason(e)}") from None


def json_schema_grammar(schema: dict | bool) -> str:
    """EBNF of the JSON texts that `schema` accepts, on one line with ", " / ": " separators and no free
    whitespace (a small model cannot loop on spaces). Strict: no properties beyond the schema's.
    Raises ValueError (the reason xgrammar gives) for a schema it cannot convert."""
    xgr = _xgrammar()
    try:
        return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"the JSON schema cannot be turned into a grammar: {_reason(e)}") from None


def _head(text: str, n: int = 120) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source prefix ("[time] path.cc:line: ")."""
    msg = str(e).strip()
    return msg.split(": ", 1)[1] if msg.startswith("[") and ": " in msg else msg


# per tokenizer, per V: (its GrammarCompiler, its compiled grammars: grammar text -> CompiledGrammar, LRU order)
_COMPILERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def compiled_grammar(tokenizer, vocab_size: int, grammar: str):
    """`grammar` compiled for this tokenizer and a logits width of `vocab_size` (cached, bounded)."""
    xgr = _xgrammar()
    with _LOCK:
        per_tokenizer = _COMPILERS.setdefault(tokenizer, {})
        if vocab_size not in per_tokenizer:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
            per_tokenizer[vocab_size] = (xgr.GrammarCompiler(info, cache_enabled=False), OrderedDict())
        compiler, cache = per_tokenizer[vocab_size]
        if grammar in cache:
            cache.move_to_end(grammar)
            return cache[grammar]
    try:
        compiled = compiler.compile_grammar(grammar)
    except RuntimeError as e:
        raise ValueError(f"grammar {_head(grammar)} does not compile: {_reason(e)}") from None
    with _LOCK:
        cache[grammar] = compiled
        while len(cache) > MAX_COMPILED or (len(cache) > 1 and sum(
                c.memory_size_bytes for c in cache.values()) > MAX_COMPILED_BYTES):
            cache.popitem(last=False)
    return compiled


class RowMatchers:
    """The grammar matchers of one decode, one per row, advanced with the tokens the rows pick: pick(picker,
    scores (B, V)) -> ids (B,), log-probs (B,) of the raw scores at the picker's temperature, mass (B,) | None."""

    def __init__(self, tokenizer, grammar: str, rows: int, eos_ids: tuple[int, ...]):
        if not eos_ids:
            raise ValueError("constrained decoding needs at least one EOS id to end a completed grammar")
        self.tokenizer, self.grammar, self.rows, self.eos = tokenizer, grammar, rows, tuple(eos_ids)
        self.matchers: list | None = None  # built at the first step, when V is known
        self.bitmask: torch.Tensor | None = None  # (B, ceil(V / 32)) int32, on CPU

    def _start(self, vocab_size: int) -> None:
        xgr = _xgrammar()
        compiled = compiled_grammar(self.tokenizer, vocab_size, self.grammar)
        self.eos = tuple(t for t in self.eos if 0 <= t < vocab_size)  # ids past the logits are never sampled
        if not self.eos:
            raise ValueError(f"constrained decoding needs an EOS id below the vocabulary size {vocab_size}")
        self.matchers = [xgr.GrammarMatcher(compiled, override_stop_tokens=list(self.eos))
                         for _ in range(self.rows)]
        self.bitmask = xgr.allocate_token_bitmask(self.rows, vocab_size)

    def masked(self, scores: torch.Tensor) -> torch.Tensor:
        """A copy of `scores` (B, V) with every token the rows' grammars forbid at -inf."""
        xgr = _xgrammar()
        B, V = scores.shape
        if B != self.rows:
            raise ValueError(f"RowMatchers was built for {self.rows} rows, got scores of {B}")
        if self.matchers is None:
            self._start(V)
        ended = []
        for i, m in enumerate(self.matchers):
            if m.is_terminated():
                ended.append(i)
            else:
                m.fill_next_token_bitmask(self.bitmask, i)
        out = scores.clone()
        xgr.apply_token_bitmask_inplace(out, self.bitmask.to(scores.device, non_blocking=True), vocab_size=V)
        if ended:
            rows = torch.tensor(ended, device=scores.device)
            out[rows] = float("-inf")
            out[rows, self.eos[0]] = 0.0
        return out

    def advance(self, ids: list[int]) -> None:
        """Each row's matcher accepts its picked id (a terminated row's id is ignored)."""
        for m, tok in zip(self.matchers, ids, strict=True):
            if not m.is_terminated() and not m.accept_token(tok):
                raise RuntimeError(f"the grammar matcher refused token {tok} that its own mask allowed")

    def pick(self, picker, scores: torch.Tensor):
        """The picker's choice from the masked scores, with the log-prob of the raw scores (before the mask)."""
        tok, _, mass = picker.pick(self.masked(scores))  # (B,)
        inv_t = picker.inv_t
        raw = scores.float()
        logprob = raw.gather(1, tok[:, None]).squeeze(1) * inv_t - torch.logsumexp(raw * inv_t, dim=-1)  # (B,)
        self.advance(tok.tolist())
        return tok, logprob, mass
