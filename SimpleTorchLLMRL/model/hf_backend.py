"""The HF backend of `ModelGenerate`: left-padded batched `model.generate` with log-probs recorded on the fly.

Legend: B batch (prompts x n samples), L longest prompt, N new tokens, V vocab.

Recorded log-probs are log_softmax(raw logits / T) of the chosen token, before any
top-k / top-p truncation. Greedy: `_LogprobRecorder` keeps each step's log-softmax and
gathers the token HF picked. Sampling: the last logits processor (`_Sampler`, inverse
CDF, one uniform per row) draws the token and records its log-prob, and `generate`
runs greedy so HF's argmax takes that token; with top-k / top-p, `_RawStats` first keeps
the raw scores, then the warpers (temperature, top-k, top-p: ours, in HF's order)
truncate. HF's own sampling is `torch.multinomial`, an exponential race whose CPU RNG
costs ~18 ns per vocabulary entry (187 ms per step at B=64, V=151,936); the (B, V)
temporaries live in one buffer reused across steps. The model's own generation-config
sampling settings are overridden (HF would otherwise apply e.g. its default top_k=50).

The G samples of one prompt share its prefill: each distinct prompt's first L - 1 tokens
run once into a KV cache that is repeated for its rows, and `generate` continues from it
(vLLM's prefix caching does the same); `backend.share_prefill = False` turns this off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from SimpleTorchLLMRL.model.logprobs import check_vocabulary
from SimpleTorchLLMRL.model.sampling import Sample, SamplingConfig, cut_sample, find_stop, stop_window
from SimpleTorchLLMRL.model.shared_prefix import forward_last_logits, prefix_groups


class _LogprobRecorder:
    """Greedy decoding's logits processor: records log p(chosen) under logits / T.

    At step t it sees the raw (B, V) scores; the token sampled from them shows up as
    input_ids[:, -1] at step t + 1 (the last one is gathered by `finish`). Only one
    (B, V) tensor is kept, never a (B, N, V) stack.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.prev: torch.Tensor | None = None  # (B, V) float32 log-probs of the previous step
        self.logprobs: list[torch.Tensor] = []  # N x (B,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.logprobs.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        self.prev = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(B, N) log-probs of the N sampled tokens, the last column from `sequences`."""
        if self.prev is not None:
            self.logprobs.append(self.prev.gather(1, sequences[:, -1:]).squeeze(1))
            self.prev = None
        return torch.stack(self.logprobs, dim=1)


BLOCK = 1024  # vocabulary entries per first-level block of the inverse CDF


def inverse_cdf_sample(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalized probabilities p (B, V) >= 0 -> ids (B,) with P(v) = p_v / sum(p), and sum(p) (B,) float64.

    One uniform per row (torch's global RNG). Up to 4 x BLOCK entries: one float64
    cumsum; beyond: a float64 cumsum over per-block sums picks a block, a cumsum
    inside that block picks the entry (no (B, V) temporary). An entry with p = 0 is
    never picked: the target mass is kept strictly below each row's total.
    """
    B, V = p.shape
    u = torch.rand(B, 1, dtype=torch.float64, device=p.device)  # (B, 1)
    if V <= 4 * BLOCK:
        cum = p.double().cumsum(-1)  # (B, V)
        total = _check_mass(cum[:, -1:])  # (B, 1)
        target = torch.minimum(u * total, total * (1 - 1e-12))
        return torch.searchsorted(cum, target, right=True).clamp_(max=V - 1).squeeze(1), total.squeeze(1)
    nb, rem = divmod(V, BLOCK)
    parts = [p[:, : nb * BLOCK].view(B, nb, BLOCK).sum(-1)] + ([p[:, nb * BLOCK:].sum(-1, keepdim=True)] if rem else [])
    blk = torch.cat(parts, dim=1).double()  # (B, blocks)
    cum = blk.cumsum(-1)  # (B, blocks)
    total = _check_mass(cum[:, -1:])  # (B, 1)
    target = torch.minimum(u * total, total * (1 - 1e-12))
    j = torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[1] - 1)  # (B, 1) block
    before = torch.nn.functional.pad(cum[:, :-1], (1, 0))  # (B, blocks) mass of the blocks before each one
    r = target - before.gather(1, j)  # (B, 1) >= 0: cum[j - 1] <= target < cum[j]
    idx = j * BLOCK + torch.arange(BLOCK, device=p.device)  # (B, BLOCK)
    inner = p.gather(1, idx.clamp(max=V - 1)).double().masked_fill_(idx >= V, 0.0).cumsum(-1)  # (B, BLOCK)
    r = torch.minimum(r, inner[:, -1:] * (1 - 1e-12))  # float32 block sums vs float64 inner sums
    k = torch.searchsorted(inner, r, right=True).clamp_(max=BLOCK - 1)  # (B, 1)
    return (j * BLOCK + k).squeeze(1), total.squeeze(1)


def _check_mass(total: torch.Tensor) -> torch.Tensor:
    """total (B, 1) probability mass per row; raises when a row cannot be sampled from."""
    bad = ~(torch.isfinite(total) & (total > 0))
    if bool(bad.any()):
        rows = bad.flatten().nonzero().flatten().tolist()
        raise ValueError(f"cannot sample: the scores of {len(rows)} of {total.shape[0]} rows are NaN/inf or "
                         f"mask out every token (first rows: {rows[:8]})")
    return total


class _Scratch:
    """One (B, V) float32 buffer reused by every step of a generate call."""

    def __init__(self):
        self.buf: torch.Tensor | None = None

    def like(self, x: torch.Tensor) -> torch.Tensor:
        if self.buf is None or self.buf.shape != x.shape:
            self.buf = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        return self.buf


class _RawStats:
    """First processor when top-k / top-p truncate: keeps the raw scores and their log-sum-exp at T, (B, 1)."""

    def __init__(self, temperature: float, scratch: _Scratch):
        self.inv_t, self.scratch = 1.0 / temperature, scratch
        self.z: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        m = scores.amax(-1, keepdim=True)  # (B, 1)
        d = torch.sub(scores, m, out=self.scratch.like(scores))
        if self.inv_t != 1.0:
            d.mul_(self.inv_t)
        self.z = scores  # HF's warpers return new tensors and never write into this one
        self.lse = m * self.inv_t + d.exp_().sum(-1, keepdim=True).log()
        return scores


class _Sampler:
    """Last processor: samples one token per row from softmax(scores), records its log-prob under
    softmax(raw scores / T), and returns scores whose argmax is that token (generate runs greedy).

    raw=None: no warper ran, the scores are the raw ones and are tempered here (one exp
    pass serves the sampling and the log-sum-exp); otherwise they are tempered and truncated.
    """

    def __init__(self, temperature: float, scratch: _Scratch, raw: _RawStats | None = None):
        self.inv_t, self.scratch, self.raw = 1.0 / temperature, scratch, raw
        self.logprobs: list[torch.Tensor] = []  # N x (B,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        inv_t = self.inv_t if self.raw is None else 1.0
        m = scores.amax(-1, keepdim=True)  # (B, 1); warpers keep >= 1 finite score per row
        p = torch.sub(scores, m, out=self.scratch.like(scores))
        if inv_t != 1.0:
            p.mul_(inv_t)
        tok, total = inverse_cdf_sample(p.exp_())
        tok = tok[:, None]  # (B, 1)
        if self.raw is None:
            z, lse = scores, m * inv_t + total[:, None].log().float()
        else:
            z, lse = self.raw.z, self.raw.lse
        self.logprobs.append((z.gather(1, tok) * self.inv_t - lse).squeeze(1))
        return scores.fill_(float("-inf")).scatter_(1, tok, 0.0)

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(B, N) log-probs of the N sampled tokens."""
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


class HFBackend:
    """Left-padded batched `model.generate` with per-token log-probs recorded on the fly."""

    def __init__(self, model, tokenizer, cfg: SamplingConfig, batch_size: int | None = None):
        if not hasattr(model, "generate"):
            raise TypeError(f"the HF backend needs a model with .generate(), got {type(model).__name__}")
        check_vocabulary(model, tokenizer)
        self.model, self.tokenizer, self.cfg, self.batch_size = model, tokenizer, cfg, batch_size
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer needs a pad_token_id or eos_token_id to left-pad batches")
        self.pad_id = int(pad)
        self.share_prefill = True  # prefill each distinct prompt once (`_shared_prefill`)

    @property
    def logprob_temperature(self) -> float:
        return self.cfg.logprob_temperature

    @property
    def max_context(self) -> int | None:
        ctx = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return int(ctx) if ctx else None

    def generate(self, prompts: list[list[int]], n: int, seed: int | None,
                 adapter: str | None = None) -> list[list[Sample]]:
        """`n` samples per prompt; `adapter`: with that LoRA adapter of a multi-adapter peft model active."""
        from SimpleTorchLLMRL.model.adapters import use_adapter

        expanded = [p for p in prompts for _ in range(n)]  # prompt-major: p0 x n, p1 x n, ...
        step = self.batch_size or len(expanded)
        device = _device_of(self.model)
        was_training = self.model.training
        self.model.eval()
        # A seeded call runs on a forked RNG (the global stream is left alone); an unseeded call
        # draws from the global RNG, so consecutive calls give fresh samples.
        forked = seed is not None
        try:
            with contextlib.ExitStack() as stack:
                if adapter is not None:
                    stack.enter_context(use_adapter(self.model, adapter))
                stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                                                          enabled=forked))
                if forked:
                    torch.manual_seed(seed)
                flat = []
                for start in range(0, len(expanded), step):
                    flat.extend(self._generate_batch(expanded[start: start + step], device))
        finally:
            self.model.train(was_training)
        return [flat[i * n: (i + 1) * n] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[list[int]], device) -> list[Sample]:
        from transformers import LogitsProcessorList, StoppingCriteriaList

        cfg = self.cfg
        B, L = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((B, L), self.pad_id, dtype=torch.long)  # (B, L) left-padded
        attention_mask = torch.zeros((B, L), dtype=torch.long)  # (B, L)
        for i, p in enumerate(prompts):
            input_ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, L - len(p):] = 1
        recorder, processors = self._processors()
        criteria = StoppingCriteriaList([_StopOnStrings(self.tokenizer, cfg.all_stops, L)] if cfg.all_stops else [])
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        with torch.inference_mode():
            cache = self._shared_prefill(input_ids, attention_mask) if self.share_prefill else None
            seq = self.model.generate(  # greedy: sampling happens in our last processor
                input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                max_new_tokens=cfg.max_new_tokens, do_sample=False, num_beams=1, temperature=None, top_k=None,
                top_p=None, repetition_penalty=1.0, no_repeat_ngram_size=0, eos_token_id=list(cfg.eos_token_ids),
                pad_token_id=self.pad_id, logits_processor=LogitsProcessorList(processors),
                stopping_criteria=criteria,
            )
            new = seq[:, L:]  # (B, N)
            logps = recorder.finish(seq)[:, : new.shape[1]]  # (B, N)
        new_l, logps_l = new.tolist(), logps.tolist()
        return [cut_sample(self.tokenizer, ids, lps, cfg) for ids, lps in zip(new_l, logps_l, strict=True)]

    def _shared_prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """KV cache of the first L - 1 tokens of each distinct prompt, prefilled once and repeated
        for its rows (G samples of one prompt); generate then runs only the last prompt token.

        input_ids, attention_mask (B, L) left-padded. None (generate prefills as usual) when no
        prompt repeats, or the model brings its own cache kind or is an encoder-decoder.
        """
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

    def _processors(self) -> tuple:
        """(recorder with .finish, the logits-processor list) for greedy or sampled decoding."""
        cfg = self.cfg
        if cfg.greedy:
            recorder = _LogprobRecorder(cfg.logprob_temperature)
            return recorder, [recorder]
        scratch = _Scratch()
        if not cfg.truncates:  # one processor: temper, sample, record
            recorder = _Sampler(cfg.temperature, scratch)
            return recorder, [recorder]
        raw = _RawStats(cfg.temperature, scratch)
        recorder = _Sampler(cfg.temperature, scratch, raw)
        return recorder, [raw, *self._warpers(), recorder]

    def _warpers(self) -> list:
        """Temperature, then top-k, then top-p (HF's order), between `_RawStats` and `_Sampler`."""
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        cfg = self.cfg
        out = [TemperatureLogitsWarper(float(cfg.temperature))] if cfg.temperature != 1 else []
        if cfg.top_k:
            out.append(TopKLogitsWarper(top_k=cfg.top_k))
        if cfg.top_p is not None and cfg.top_p < 1:
            out.append(TopPLogitsWarper(top_p=cfg.top_p))
        return out

    def push_weights(self, model=None, mode: str = "merged", adapter=None) -> None:
        if model is not None and model is not self.model:
            raise ValueError("the HF backend generates with its own model object; pass that model (or None)")

    def sleep(self, level: int = 1) -> None:
        return None

    def wake_up(self, tags=None) -> None:
        return None


def _device_of(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")
