"""The HF backend of `ModelGenerate`: left-padded batched decoding with log-probs recorded on the fly, by
`model.generate` ("default") or `fast_decode` ("fast"), both picking with `picker.TokenPicker`, so they
sample the same ids under one seed (docs/generation.md).

Legend: B batch (prompts x n samples), L longest prompt, N new tokens, V vocab.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch

from SimpleTorchLLMRL.model.generation.picker import TokenPicker, checked_mass, row_keys
from SimpleTorchLLMRL.model.generation.sampling import (
    Sample,
    SamplingConfig,
    cut_sample,
    find_stop,
    stop_window,
)
from SimpleTorchLLMRL.model.scoring.head import check_vocabulary, model_vocab_size
from SimpleTorchLLMRL.model.scoring.shared_prefix import forward_last_logits, prefix_groups


class _Picker:
    """`generate`'s only logits processor: picks each row's token (`TokenPicker`; under a grammar from
    the scores its mask leaves, `constrain.RowMatchers`), records its log-prob, and returns scores
    whose argmax is that token (`generate` runs greedy)."""

    def __init__(self, cfg: SamplingConfig, keys: list[int], device, matchers=None):
        self.picker, self.matchers = TokenPicker(cfg), matchers
        self.picker.start(keys, device)
        self.logprobs: list[torch.Tensor] = []  # N x (B,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.matchers is not None:
            tok, logprob, mass = self.matchers.pick(self.picker, scores)
        else:
            tok, logprob, mass = self.picker.pick(scores)
        if mass is not None:
            checked_mass(mass, True)
        self.logprobs.append(logprob)
        return scores.fill_(float("-inf")).scatter_(1, tok[:, None], 0.0)

    def finish(self) -> torch.Tensor:
        """(B, N) log-probs of the N picked tokens."""
        return torch.stack(self.logprobs, dim=1)


class _StopOnStrings:
    """Stopping criterion: a row is done once its generated tail contains a stop string."""

    def __init__(self, tokenizer, stops: Sequence[str], prompt_len: int):
        self.tokenizer, self.stops, self.prompt_len = tokenizer, tuple(stops), prompt_len
        self.window = stop_window(stops)

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        gen = input_ids[:, self.prompt_len:].tolist()  # (B, t)
        hits = [find_stop(self.tokenizer, row, self.stops, self.window) is not None for row in gen]
        return torch.tensor(hits, dtype=torch.bool, device=input_ids.device)


class _WatchSteps:
    """Stopping criterion that hands each step's new ids to a `DecodeWatch` and ends the rows it cancels
    (`generate` then pads them; the other rows' ids do not change)."""

    def __init__(self, watch, prompt_len: int, rows: int):
        self.watch, self.prompt_len, self.gone = watch, prompt_len, [False] * rows

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        t = input_ids.shape[1] - self.prompt_len  # ids sampled so far
        last = input_ids[:, -1].tolist()  # (B,): generate syncs with the host every step anyway
        live = [i for i, gone in enumerate(self.gone) if not gone]
        self.watch.tokens(live, [[last[i]] for i in live])
        for i in live:
            if self.watch.is_cancelled(i):
                self.gone[i] = True
                self.watch.give_up(i, t)
        return torch.tensor(self.gone, dtype=torch.bool, device=input_ids.device)


class HFBackend:
    """`ModelGenerate`'s backend over an HF model (module docstring); `decode`: "default", "fast" or "auto"."""

    def __init__(self, model, tokenizer, cfg: SamplingConfig, batch_size: int | None = None,
                 decode: str = "auto"):
        if not hasattr(model, "generate"):
            raise TypeError(f"the HF backend needs a model with .generate(), got {type(model).__name__}")
        self.model = model
        if decode == "fast" and not self.fast_ok:
            raise ValueError(f"decode='fast' needs a decoder-only model whose transformers StaticCache has only "
                             f"full-attention layers; {type(model).__name__} has not (use decode='default')")
        check_vocabulary(model, tokenizer)
        self.vocab_size = model_vocab_size(model)  # the logits' width: the ids a logit_bias may name
        self.decode = decode
        self.compile_decode: bool | None = None  # fast decode: torch.compile its forward (None: on CUDA)
        # cfg: the generator's defaults (`logprob_temperature`); `generate` reads only the SamplingConfig it gets
        self.tokenizer, self.cfg, self.batch_size = tokenizer, cfg, batch_size
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer needs a pad_token_id or eos_token_id to left-pad batches")
        self.pad_id = int(pad)
        self.share_prefill = True  # prefill each distinct prompt once (`_shared_prefill`)

    mixed_adapters = False  # one adapter per generate call (peft activates one at a time)
    supports_top_logprobs = True

    def check_sampling(self, sampling: SamplingConfig) -> None:
        """Nothing to refuse: the HF loop records log-probs under any settings."""

    def prepare_grammar(self, grammar: str) -> None:
        from SimpleTorchLLMRL.model.generation.constrain import compiled_grammar

        compiled_grammar(self.tokenizer, self.vocab_size, grammar)

    def top_logprobs(self, prompt_ids: list[int], token_ids: list[int], temperature: float,
                     k: int) -> list[list[tuple[int, float]]]:
        """The k most likely ids and their log-probs at each of `token_ids`' positions, under logits /
        temperature: one forward of the model over prompt + reply (the gateway's top_logprobs)."""
        ids = torch.tensor([list(prompt_ids) + list(token_ids)], device=_device_of(self.model))  # (1, P + N)
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0, len(prompt_ids) - 1: -1].float()  # (N, V)
        logp = torch.log_softmax(logits / temperature, dim=-1)  # (N, V)
        values, index = logp.topk(min(k, logp.shape[-1]), dim=-1)  # (N, k)
        return [list(zip(r.tolist(), v.tolist(), strict=True)) for r, v in zip(index, values, strict=True)]

    @property
    def logprob_temperature(self) -> float:
        return self.logprob_temperature_for(self.cfg)

    def logprob_temperature_for(self, sampling: SamplingConfig) -> float:
        return sampling.logprob_temperature

    @property
    def max_context(self) -> int | None:
        ctx = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return int(ctx) if ctx else None

    def generate(self, prompts: list[list[int]], n: int, seeds: list[int], *, sampling: SamplingConfig,
                 adapter: str | None = None, watch=None) -> list[list[Sample]]:
        """`Backend.generate` (streams keyed by `picker.row_keys`); `adapter`: with that LoRA adapter of a
        multi-adapter peft model active."""
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        sampling.check_vocabulary(self.vocab_size)
        expanded = [p for p in prompts for _ in range(n)]  # prompt-major: p0 x n, p1 x n, ...
        keys = row_keys(seeds, n)
        step = self.batch_size or len(expanded)
        device = _device_of(self.model)
        was_training = self.model.training
        self.model.eval()
        try:
            with contextlib.ExitStack() as stack:
                if adapter is not None:
                    from SimpleTorchLLMRL.model.adapters import use_adapter

                    stack.enter_context(use_adapter(self.model, adapter))
                flat = []
                for start in range(0, len(expanded), step):
                    rows = slice(start, start + step)
                    part = None if watch is None else watch.select(range(start, start + len(expanded[rows])))
                    flat.extend(self._generate_batch(expanded[rows], keys[rows], device, sampling, adapter, part))
        finally:
            self.model.train(was_training)
        return [flat[i * n: (i + 1) * n] for i in range(len(prompts))]

    @functools.cached_property
    def fast_ok(self) -> bool:
        """Whether the model can take the fast decode (asked once, and only where it may be used)."""
        from SimpleTorchLLMRL.model.generation.fast_decode import supports_fast_decode

        return supports_fast_decode(self.model)

    def uses_fast_decode(self, device: torch.device) -> bool:
        return self.decode == "fast" or (self.decode == "auto" and device.type == "cuda" and self.fast_ok)

    def _generate_batch(self, prompts: list[list[int]], keys: list[int], device, cfg: SamplingConfig,
                        adapter: str | None = None, watch=None) -> list[Sample]:
        B, L = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((B, L), self.pad_id, dtype=torch.long)  # (B, L) left-padded
        attention_mask = torch.zeros((B, L), dtype=torch.long)  # (B, L)
        for i, p in enumerate(prompts):
            input_ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, L - len(p):] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        with torch.inference_mode():
            if self.uses_fast_decode(device) and cfg.grammar is None:  # a grammar's mask needs the host per step
                new, logps = self._fast_decode(input_ids, attention_mask, keys, device, cfg, adapter, watch)
            else:
                shared = len({tuple(p) for p in prompts}) < B  # some prompt repeats: prefill it once
                new, logps = self._hf_generate(input_ids, attention_mask, keys, cfg, watch, shared)
        new_l, logps_l = new.tolist(), logps.tolist()
        if watch is not None:  # a cancelled row keeps what it sampled before it was given up
            for i in range(B):
                at = watch.given_up_at(i)
                if at is not None:
                    new_l[i], logps_l[i] = new_l[i][:at], logps_l[i][:at]
        return [cut_sample(self.tokenizer, ids, lps, cfg) for ids, lps in zip(new_l, logps_l, strict=True)]

    def _fast_decode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keys: list[int], device,
                     cfg: SamplingConfig, adapter: str | None, watch=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, n) ids and log-probs from the static-cache decoder of this shape (built, or reused from an
        earlier call on this model: one per model, `fast_decode.DECODERS`)."""
        from SimpleTorchLLMRL.model.generation.fast_decode import (
            CHECK_EVERY,
            DECODERS,
            StaticDecoder,
            may_compile,
            slots_for,
        )

        B, L = input_ids.shape
        slots = slots_for(L, cfg.max_new_tokens)
        weights = tuple(p.data_ptr() for p in self.model.parameters())
        key = (B, slots, str(device), adapter, weights, self.compile_decode)
        held = DECODERS.get(self.model)
        if held is None or held[0] != key:
            self.sleep()  # free the old cache and graph first
            compile = self.compile_decode if self.compile_decode is not None else device.type == "cuda"
            compile = compile and may_compile(self.model, B, slots)
            held = (key, StaticDecoder(self.model, B, slots, device, graphs=True, compile=compile))
            DECODERS[self.model] = held
        pick_key = (cfg.greedy, cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, cfg.eos_token_ids, cfg.logit_bias,
                    cfg.frequency_penalty, cfg.presence_penalty)
        held[1].use_picker(TokenPicker(cfg), pick_key, cfg.eos_token_ids)
        held[1].picker.start(keys, device)  # into the held picker's buffers (a captured graph reads them)
        stops = cfg.all_stops
        window = stop_window(stops) + CHECK_EVERY if stops else 0

        def row_stopped(rows: list[list[int]]) -> list[bool]:
            return [find_stop(self.tokenizer, row, stops, window) is not None for row in rows]

        return held[1].decode(input_ids, attention_mask, cfg.max_new_tokens, row_stopped if stops else None, watch)

    def _hf_generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keys: list[int],
                     cfg: SamplingConfig, watch=None, shared: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N) ids and log-probs from `model.generate` (greedy over our picker's forced scores)."""
        from transformers import LogitsProcessorList, StoppingCriteriaList

        B, L = input_ids.shape
        matchers = None
        if cfg.grammar is not None:
            from SimpleTorchLLMRL.model.generation.constrain import RowMatchers

            matchers = RowMatchers(self.tokenizer, cfg.grammar, B, cfg.eos_token_ids)
        picker = _Picker(cfg, keys, input_ids.device, matchers)
        criteria = StoppingCriteriaList([_StopOnStrings(self.tokenizer, cfg.all_stops, L)] if cfg.all_stops else [])
        if watch is not None:
            criteria.append(_WatchSteps(watch, L, B))
        cache = self._shared_prefill(input_ids, attention_mask) if self.share_prefill and shared else None
        seq = self.model.generate(  # greedy over our processor; the model's own sampling defaults overridden
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
            max_new_tokens=cfg.max_new_tokens, do_sample=False, num_beams=1, temperature=None, top_k=None,
            top_p=None, repetition_penalty=1.0, no_repeat_ngram_size=0, eos_token_id=list(cfg.eos_token_ids),
            pad_token_id=self.pad_id, logits_processor=LogitsProcessorList([picker]), stopping_criteria=criteria)
        new = seq[:, L:]  # (B, N)
        return new, picker.finish()[:, : new.shape[1]]  # (B, N)

    def _shared_prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """KV cache of the first L - 1 tokens of each distinct prompt of input_ids, attention_mask (B, L), prefilled
        once and repeated for its rows (docs/generation.md, "One prefill per prompt"); None where generate
        prefills as usual (no prompt repeats, an encoder-decoder, a model with its own cache kind)."""
        config = getattr(self.model, "config", None)
        gen_config = getattr(self.model, "generation_config", None)
        if (input_ids.shape[1] < 2 or getattr(config, "is_encoder_decoder", False)
                or getattr(gen_config, "cache_implementation", None) is not None):
            return None
        B, L = input_ids.shape
        groups = prefix_groups(input_ids, torch.full((B,), L))  # rows equal in all L (padded) tokens
        if groups is None:
            return None
        group, owner = groups
        ids, mask = input_ids[owner, :-1], attention_mask[owner, :-1]  # (U, L - 1)
        positions = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 0)  # as generate numbers a left-padded prompt
        out = forward_last_logits(self.model, input_ids=ids, attention_mask=mask, position_ids=positions,
                                  use_cache=True)
        cache = getattr(out, "past_key_values", None)
        if cache is None or not hasattr(cache, "batch_select_indices"):
            return None
        cache.batch_select_indices(group)  # (U, ...) -> (B, ...)
        return cache

    def push_weights(self, model=None, mode: str = "merged", adapter=None) -> None:
        if model is not None and model is not self.model:
            raise ValueError("the HF backend generates with its own model object; pass that model (or None)")

    def sleep(self, level: int = 1) -> None:
        """Free the fast decode's KV cache and CUDA graph (rebuilt at the next call)."""
        from SimpleTorchLLMRL.model.generation.fast_decode import DECODERS

        DECODERS.pop(self.model, None)

    def wake_up(self, tags=None) -> None:
        return None


def _device_of(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")
