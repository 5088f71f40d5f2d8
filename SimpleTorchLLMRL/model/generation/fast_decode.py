"""A fast HF decode: a static KV cache, a compiled forward, and each decode step as one CUDA graph replay.

Legend: B rows, L longest prompt, N new tokens, S cache slots (L + N rounded up to SLOT_ROUND), V vocab.

    tok, logprob, mass = picker.pick(logits)        # (B,) each: the default path's `TokenPicker`, same RNG draws
    ids[:, t], logprobs[:, t] = tok, logprob
    mask[:, :, :, L + t] = True                     # (B, 1, 1, S) bool: slot L + t now holds a token
    logits = model(tok (B, 1), positions (B, 1), mask, cache).logits[:, -1]

That step is captured once on CUDA and replayed (eager on CPU); one `StaticDecoder` per model (`DECODERS`).
docs/generation.md, "Fast decode", says more.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Callable

import torch

from SimpleTorchLLMRL.model.generation.picker import mass_error

SLOT_ROUND = 64  # cache slots are rounded up to a multiple of this, so calls with similar lengths share a graph
CHECK_EVERY = 16  # decode steps between checks for "every row has ended" (one host sync each)
STREAM_EVERY = 4  # the same while a `DecodeWatch` streams: new ids reach it this often
DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (key, StaticDecoder)
MAX_COMPILED_SHAPES = 4  # per model: each new (rows, slots) shape compiles once; later ones run graphs only
_COMPILED_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(rows, slots)}


def supports_fast_decode(model) -> bool:
    """Whether `model` decodes through a StaticCache of plain full-attention layers."""
    try:
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer
    except ImportError:
        return False
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or not hasattr(model, "generate"):
        return False
    try:
        cache = StaticCache(config=config, max_cache_len=SLOT_ROUND)
    except Exception:  # noqa: BLE001  (a config transformers cannot build a static cache for)
        return False
    return bool(cache.layers) and all(type(layer) is StaticLayer for layer in cache.layers)


def slots_for(prompt_len: int, new_tokens: int) -> int:
    return -(-(prompt_len + new_tokens) // SLOT_ROUND) * SLOT_ROUND


def _takes_cache_position(model) -> bool:
    """transformers versions whose forward still takes `cache_position` (the static cache reads it)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache_position" in inspect.signature(type(base).forward).parameters


def _decode_forward(model, tok: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache, slot: torch.Tensor,
                    cache_position: bool) -> torch.Tensor:
    """The model on one token per row (B, 1) with the static cache -> its (B, V) logits (compiled on CUDA)."""
    extra = {"cache_position": slot} if cache_position else {}
    out = model(input_ids=tok, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True, **extra)
    return out.logits[:, -1]


@functools.cache
def compiled_forward():
    """`_decode_forward` under `torch.compile` (fullgraph: a model it cannot trace fails before running)."""
    return torch.compile(_decode_forward, fullgraph=True, dynamic=False)


def may_compile(model, rows: int, slots: int) -> bool:
    """Whether this shape's decoder gets the compiled forward: the first MAX_COMPILED_SHAPES shapes of a model
    do (multi-turn episodes give each turn its own row count; each compile takes seconds to minutes)."""
    shapes = _COMPILED_SHAPES.setdefault(model, set())
    if (rows, slots) in shapes or len(shapes) < MAX_COMPILED_SHAPES:
        shapes.add((rows, slots))
        return True
    if len(shapes) == MAX_COMPILED_SHAPES:
        shapes.add(None)  # warned
        warnings.warn(f"fast decode: {MAX_COMPILED_SHAPES} batch shapes of this model are compiled already; new "
                      "shapes run their CUDA graph without torch.compile (set fast_decode.MAX_COMPILED_SHAPES to "
                      "compile more)", RuntimeWarning, stacklevel=3)
    return False


class StaticDecoder:
    """One batch shape (B rows, S cache slots): its StaticCache, step buffers, the compiled decode forward
    (`compile`) and, on CUDA, the CUDA graph of a step with one picker. The graph holds the addresses of
    everything the step touches, so the decoder keeps them (the picker's scratch buffer included); a
    picker with other settings is captured anew, the cache and compiled forward stay."""

    def __init__(self, model, rows: int, slots: int, device: torch.device, graphs: bool, compile: bool):
        from transformers import StaticCache

        self._model = weakref.ref(model)  # DECODERS is keyed by the model: no strong reference back
        self.B, self.S, self.device = rows, slots, device
        self.graphs = graphs and device.type == "cuda"
        self.forward = compiled_forward() if compile else _decode_forward
        self.cache = StaticCache(config=model.config, max_cache_len=slots)
        self.cache_position = _takes_cache_position(model)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.picker, self.pick_key = None, None
        B, S = rows, slots
        self.mask = torch.zeros(B, 1, 1, S, dtype=torch.bool, device=device)  # (B, 1, 1, S) slots holding a token
        self.pos = torch.zeros(B, 1, dtype=torch.long, device=device)  # (B, 1) position of the next token
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # the slot the next token goes to
        self.t = torch.zeros(1, dtype=torch.long, device=device)  # the step
        self.ids = torch.zeros(B, S, dtype=torch.long, device=device)  # (B, S) picked ids by step
        self.logprobs = torch.zeros(B, S, dtype=torch.float32, device=device)  # (B, S)
        self.ended = torch.zeros(B, dtype=torch.bool, device=device)  # (B,) picked an EOS id
        self.bad = torch.zeros(B, dtype=torch.bool, device=device)  # (B,) a step had nothing to sample
        self.eos = torch.zeros(0, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None  # (B, V) float32 scores of the next token

    def use_picker(self, picker, pick_key: tuple, eos_ids: tuple[int, ...]) -> None:
        """Pick with `picker` (a `TokenPicker`) unless one with the same `pick_key` is already held."""
        if pick_key != self.pick_key:
            self.graph = None
            self.picker, self.pick_key = picker, pick_key
            self.eos = torch.tensor(eos_ids, dtype=torch.long, device=self.device)

    def decode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int,
               row_stopped: Callable[[list[list[int]]], list[bool]] | None, watch=None):
        """input_ids, attention_mask (B, L) left-padded -> ids (B, n), log-probs (B, n), n <= new_tokens.
        `row_stopped(ids of some rows so far)` says which of them a stop string ended (None: EOS only);
        `watch` (a `DecodeWatch`, or None): gets the new ids at each host check (every STREAM_EVERY steps when
        it streams), and the rows it cancels count as ended. `use_picker` first."""
        B, L = input_ids.shape
        if L + new_tokens > self.S or B != self.B:
            raise ValueError(f"this decoder holds {self.B} rows x {self.S} slots, not {B} x {L} + {new_tokens}")
        self._prefill(input_ids, attention_mask)
        stopped, watched = [False] * B, _Watched(watch, B) if watch is not None else None
        every = STREAM_EVERY if watch is not None and watch.streams else CHECK_EVERY
        t = 0
        for t in range(new_tokens):
            self._advance(t)
            if (t + 1) % every == 0 or t + 1 == new_tokens:
                if self._all_ended(t + 1, row_stopped, stopped, watched):
                    break
        n = t + 1
        return self.ids[:, :n], self.logprobs[:, :n]

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """The prompts into slots 0..L-1; the buffers set for step 0."""
        from SimpleTorchLLMRL.model.scoring.shared_prefix import forward_last_logits

        B, L = input_ids.shape
        self.cache.reset()
        real = attention_mask.bool()  # (B, L)
        causal = torch.ones(L, L, dtype=torch.bool, device=self.device).tril_()  # (L, L)
        own = torch.eye(L, dtype=torch.bool, device=self.device)  # a padding query sees itself: no all-masked row
        prompt_mask = causal & (real[:, None, :] | own)  # (B, L, L)
        full = torch.zeros(B, 1, L, self.S, dtype=torch.bool, device=self.device)  # (B, 1, L, S)
        full[:, 0, :, :L] = prompt_mask
        positions = (real.long().cumsum(-1) - 1).clamp_(min=0)  # (B, L) as generate numbers left-padded rows
        extra = {"cache_position": torch.arange(L, device=self.device)} if self.cache_position else {}
        out = forward_last_logits(self._model(), input_ids=input_ids, attention_mask=full, position_ids=positions,
                                  past_key_values=self.cache, use_cache=True, **extra)
        scores = out.logits[:, -1].float()  # (B, V)
        if self.logits is None or self.logits.shape != scores.shape:
            self.logits, self.graph = torch.empty_like(scores), None
        self.logits.copy_(scores)
        self.picker.prepare(scores)  # buffers allocated before any capture or trace; penalty counts zeroed
        self.mask.zero_()
        self.mask[:, 0, 0, :L] = real
        self.pos.copy_(real.sum(-1, keepdim=True))
        self.slot.fill_(L)
        self.t.zero_()
        self.ended.zero_()
        self.bad.zero_()

    def _step(self) -> None:
        """One decode step on the buffers: no host sync, no Python state (captured as is)."""
        tok, logprob, mass = self.picker.pick(self.logits)  # (B,), (B,), (B,) | None
        self.ids.index_copy_(1, self.t, tok[:, None])
        self.logprobs.index_copy_(1, self.t, logprob[:, None].float())
        if mass is not None:
            self.bad.logical_or_(~(torch.isfinite(mass) & (mass > 0)))
        self.ended.logical_or_(torch.isin(tok, self.eos))
        self.mask.index_fill_(3, self.slot, True)
        self.logits.copy_(self._forward(tok[:, None]))
        self.pos.add_(1)
        self.slot.add_(1)
        self.t.add_(1)

    def _forward(self, tok: torch.Tensor) -> torch.Tensor:
        args = (self._model(), tok, self.mask, self.pos, self.cache, self.slot, self.cache_position)
        if self.forward is _decode_forward:
            return _decode_forward(*args)
        try:
            return self.forward(*args)
        except Exception as e:  # noqa: BLE001  (fullgraph: a failed compile ran nothing; run it uncompiled)
            warnings.warn(f"fast decode: torch.compile could not compile the decode forward ({type(e).__name__}: "
                          f"{str(e)[:500]}); it runs uncompiled", RuntimeWarning, stacklevel=4)
            self.forward = _decode_forward
            return _decode_forward(*args)

    def _advance(self, t: int) -> None:
        """Step t: replayed when a graph is held; the first step eagerly (on a side stream, as CUDA graphs
        want their warm-up), then captured for the next ones."""
        if self.graph is not None:
            self.graph.replay()
            return
        if not self.graphs:
            self._step()
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # a trainer thread may run
                self._step()
        except Exception as e:  # noqa: BLE001  (a model whose forward is not capturable: stay eager)
            warnings.warn(f"fast decode: the decode step could not be captured as a CUDA graph "
                          f"({type(e).__name__}: {e}); it runs eagerly with the static cache", RuntimeWarning,
                          stacklevel=3)
            self.graphs = False
            return
        self.graph = graph

    def _all_ended(self, n: int, row_stopped, stopped: list[bool], watched: _Watched | None = None) -> bool:
        error = mass_error(self.bad)
        if error is not None:
            raise error
        ended = self.ended.tolist()
        if watched is not None:
            watched.check(self.ids, n, ended, stopped)
        if row_stopped is not None:
            live = [i for i in range(self.B) if not (ended[i] or stopped[i])]
            rows = self.ids[live, :n].tolist() if live else []
            for i, hit in zip(live, row_stopped(rows), strict=True):
                stopped[i] = hit
        return all(e or s for e, s in zip(ended, stopped, strict=True))


class _Watched:
    """A `DecodeWatch` at the fast decode's host checks: the ids since the last check to the rows still going,
    and the rows it cancels marked stopped."""

    def __init__(self, watch, rows: int):
        self.watch, self.sent, self.quiet = watch, 0, [False] * rows  # quiet: ended or stopped at an earlier check

    def check(self, ids: torch.Tensor, n: int, ended: list[bool], stopped: list[bool]) -> None:
        live = [i for i, q in enumerate(self.quiet) if not q]
        if live:
            self.watch.tokens(live, ids[live, self.sent:n].tolist())  # (len(live), n - sent)
        for i in live:
            if not (ended[i] or stopped[i]) and self.watch.is_cancelled(i):
                stopped[i] = True
                self.watch.give_up(i, n)
            self.quiet[i] = ended[i] or stopped[i]
        self.sent = n
