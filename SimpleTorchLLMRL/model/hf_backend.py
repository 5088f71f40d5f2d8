"""The HF backend of `ModelGenerate`: left-padded batched `model.generate` with log-probs recorded on the fly.

Legend: B batch (prompts x n samples), L longest prompt, N new tokens, V vocab.

The sampling warpers (temperature, top-k, top-p) are ours and run after a recorder
that sees the raw logits, so the recorded log-probs are log_softmax(logits / T)
before truncation. The model's own generation-config sampling settings are
overridden (HF would otherwise apply e.g. its default top_k=50).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from SimpleTorchLLMRL.model.generate import Sample, SamplingConfig, cut_sample, find_stop, stop_window


class _LogprobRecorder:
    """Logits processor placed before any warper: records log p(sampled) under logits / T.

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
        self.model, self.tokenizer, self.cfg, self.batch_size = model, tokenizer, cfg, batch_size
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer needs a pad_token_id or eos_token_id to left-pad batches")
        self.pad_id = int(pad)

    @property
    def logprob_temperature(self) -> float:
        return self.cfg.logprob_temperature

    @property
    def max_context(self) -> int | None:
        ctx = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return int(ctx) if ctx else None

    def generate(self, prompts: list[list[int]], n: int, seed: int | None) -> list[list[Sample]]:
        expanded = [p for p in prompts for _ in range(n)]  # prompt-major: p0 x n, p1 x n, ...
        step = self.batch_size or len(expanded)
        device = _device_of(self.model)
        was_training = self.model.training
        self.model.eval()
        try:
            # A seeded call runs on a forked RNG (the global stream is left alone); an unseeded call
            # draws from the global RNG, so consecutive calls give fresh samples.
            forked = seed is not None
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], enabled=forked):
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
        recorder = _LogprobRecorder(cfg.logprob_temperature)
        processors = LogitsProcessorList([recorder, *self._warpers()])
        criteria = StoppingCriteriaList([_StopOnStrings(self.tokenizer, cfg.all_stops, L)] if cfg.all_stops else [])
        sampling = {} if cfg.greedy else dict(temperature=1.0, top_k=0, top_p=1.0)  # our warpers do the work
        with torch.inference_mode():
            seq = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                max_new_tokens=cfg.max_new_tokens, do_sample=not cfg.greedy, num_beams=1,
                repetition_penalty=1.0, no_repeat_ngram_size=0, eos_token_id=list(cfg.eos_token_ids),
                pad_token_id=self.pad_id, logits_processor=processors, stopping_criteria=criteria, **sampling,
            )
            new = seq[:, L:]  # (B, N)
            logps = recorder.finish(seq)[:, : new.shape[1]]  # (B, N)
        new_l, logps_l = new.tolist(), logps.tolist()
        return [cut_sample(self.tokenizer, ids, lps, cfg) for ids, lps in zip(new_l, logps_l, strict=True)]

    def _warpers(self) -> list:
        """Temperature, then top-k, then top-p (HF's order), applied after the recorder."""
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        cfg = self.cfg
        if cfg.greedy:
            return []
        out = [TemperatureLogitsWarper(float(cfg.temperature))] if cfg.temperature != 1 else []
        if cfg.top_k:
            out.append(TopKLogitsWarper(top_k=cfg.top_k))
        if cfg.top_p is not None and cfg.top_p < 1:
            out.append(TopPLogitsWarper(top_p=cfg.top_p))
        return out

    def push_weights(self, model=None, mode: str = "merged") -> None:
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
