"""The vLLM backend of `ModelGenerate` (vllm imported only when used), and weight pushes into the engine.

Legend: B prompts, n samples per prompt.

Which `logprobs_mode` records what this library records: `logprobs_mode_problem` (docs/generation.md, "vLLM
backend"). A call with a `watch` steps the engine itself (`vllm_stream`); every push is checked (`vllm_engine`).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterable

import torch

from SimpleTorchLLMRL.model.generation.sampling import Sample, SamplingConfig, clamp_logprob
from SimpleTorchLLMRL.model.generation.vllm_engine import (
    compare_probe,
    engine_model_config,
    import_vllm,
    make_llm,
    probe_ids,
    reload_weights,
    trainer_probe,
)

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def logprobs_mode_problem(mode: str, cfg: SamplingConfig) -> str | None:
    """Why vLLM's `logprobs_mode` cannot give the log-probs `cfg` records; None if it can."""
    if mode not in LOGPROBS_MODES:
        return f"logprobs_mode={mode!r} returns logits, not log-probs; use one of {LOGPROBS_MODES}"
    if mode == "processed_logprobs" and cfg.shifts_logits:
        return ("logprobs_mode='processed_logprobs' reports log-probs after logit_bias / frequency_penalty / "
                "presence_penalty, not of the raw logits; create the engine with vllm.LLM(..., "
                "logprobs_mode='raw_logprobs') and sample at temperature=1 (or greedy), or drop them")
    if cfg.grammar is not None and not cfg.greedy and cfg.temperature != 1:
        return (f"a grammar on the vLLM backend records log-probs at temperature 1 only (vLLM masks the logits before "
                f"its log-probs; they are rescored from the raw logits), got temperature={cfg.temperature}; use "
                "temperature 1 or greedy")
    if cfg.greedy:
        return None  # greedy: vLLM applies no temperature / truncation; recorded at T = 1
    if mode == "raw_logprobs" and cfg.records_truncated:
        return ("top-k/top-p/min-p turns record log-probs under the truncated distribution they were drawn from, "
                "which vLLM reports with vllm.LLM(..., logprobs_mode='processed_logprobs'), not 'raw_logprobs'")
    if mode == "raw_logprobs" and cfg.temperature != 1:
        if cfg.truncates:
            return ("vLLM cannot report log-probs at temperature != 1 before top-k/top-p with logit_bias or "
                    "penalties; use temperature=1 or drop top_k/top_p")
        return (f"logprobs_mode='raw_logprobs' reports log-probs at temperature 1, not {cfg.temperature}; "
                "create the engine with vllm.LLM(..., logprobs_mode='processed_logprobs')")
    return None


class VLLMBackend:
    """`ModelGenerate`'s backend over a `vllm.LLM` (token-id prompts in, sampled ids and log-probs out)."""

    check_pushes = True  # after every push, the engine's probe log-probs must match the trainer's

    def __init__(self, llm, tokenizer, cfg: SamplingConfig, lora_request=None, vllm_kwargs: dict | None = None):
        self.vllm = import_vllm()
        if isinstance(llm, str):  # a model path: build the engine with the log-probs mode we need
            llm = make_llm(llm, temperature=0.0 if cfg.greedy else cfg.temperature,
                           truncated=cfg.records_truncated, **(vllm_kwargs or {}))
        elif vllm_kwargs:
            raise ValueError("vllm_kwargs only apply when ModelGenerate builds the engine from a model path")
        # cfg: the generator's defaults (the engine is built for them); `generate` reads only the config it gets
        self.llm, self.cfg, self.lora_request = llm, cfg, lora_request
        self.tokenizer = tokenizer if tokenizer is not None else llm.get_tokenizer()
        model_config = engine_model_config(llm)
        self.logprobs_mode = getattr(model_config, "logprobs_mode", "raw_logprobs")
        self.max_context = getattr(model_config, "max_model_len", None)
        get_vocab = getattr(model_config, "get_vocab_size", None)
        self.vocab_size = int(get_vocab()) if callable(get_vocab) else None  # ids logit_bias may name
        self.check_sampling(cfg)
        self._adapter_id = 0
        self.lora_requests: dict = {}  # adapter name -> LoRARequest (one per agent; see push_weights)
        self._adapter_dirs: dict[str | None, str] = {}  # adapter name (None: the policy's) -> its export
        self._asleep: set[str] = set()
        self._pending: list = []  # pushes whose agreement check waits for the engine to wake up
        self.last_agreement: float | None = None  # max |d log p| of the last checked push

    mixed_adapters = True  # one generate call serves prompts of several adapters (one LoRARequest each)
    supports_top_logprobs = False  # the engine scores only what it sampled (logprobs=0)

    def top_logprobs(self, prompt_ids: list[int], token_ids: list[int], temperature: float,
                     k: int) -> list[list[tuple[int, float]]]:
        raise ValueError("top log-probs need the HF backend: this engine records only the sampled ids' log-probs")

    def prepare_grammar(self, grammar: str) -> None:
        from SimpleTorchLLMRL.model.generation.constrain import check_grammar

        check_grammar(grammar)

    def check_sampling(self, cfg: SamplingConfig) -> None:
        problem = logprobs_mode_problem(self.logprobs_mode, cfg)
        if problem:
            raise ValueError(problem)

    @property
    def logprob_temperature(self) -> float:
        return self.logprob_temperature_for(self.cfg)

    def logprob_temperature_for(self, sampling: SamplingConfig) -> float:
        """The temperature a call with `sampling` records its log-probs under (greedy: the raw logits, 1)."""
        return 1.0 if sampling.greedy else float(sampling.temperature)

    def _sampling_params(self, cfg: SamplingConfig, n: int, seed: int | None):
        extra = {}
        if cfg.grammar is not None:  # the engine's own structured outputs (its xgrammar backend)
            from vllm.sampling_params import StructuredOutputsParams

            extra["structured_outputs"] = StructuredOutputsParams(grammar=cfg.grammar)
        return self.vllm.SamplingParams(
            n=n, temperature=0.0 if cfg.greedy else float(cfg.temperature),
            top_p=1.0 if cfg.top_p is None else float(cfg.top_p), top_k=int(cfg.top_k or 0), min_p=cfg.min_p,
            max_tokens=cfg.max_new_tokens, stop=list(cfg.all_stops) or None,
            stop_token_ids=list(cfg.eos_token_ids) or None, include_stop_str_in_output=True,
            logprobs=0, seed=seed, skip_special_tokens=True,
            logit_bias=dict(cfg.logit_bias) or None, frequency_penalty=cfg.frequency_penalty,
            presence_penalty=cfg.presence_penalty, **extra)

    def _lora_for(self, adapter: str | None):
        if adapter is None:
            return self.lora_request
        if adapter not in self.lora_requests:
            raise ValueError(f"no adapter {adapter!r} was pushed to the engine (pushed: {sorted(self.lora_requests)}); "
                             f"call push_weights(model, mode='adapter', adapter={adapter!r}) first")
        return self.lora_requests[adapter]

    def generate(self, prompts: list[list[int]], n: int, seeds: list[int], *, sampling: SamplingConfig,
                 adapter: str | list[str | None] | None = None, watch=None) -> list[list[Sample]]:
        """`Backend.generate`, refused where this engine's log-probs mode cannot record `sampling`; `adapter`: a
        pushed adapter's name, or one (or None) per prompt. With `watch` the engine is stepped here
        (`vllm_stream.step_watched`), giving the samples `LLM.generate` gives for the same seed."""
        from vllm.inputs import TokensPrompt

        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        self.check_sampling(sampling)
        sampling.check_vocabulary(self.vocab_size)
        # vLLM refuses n > 1 with greedy decoding: repeat the prompt instead.
        reps, per_request = (n, 1) if sampling.greedy else (1, n)
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts for _ in range(reps)]
        # a request per prompt, seeded by the prompt's own seed (vLLM seeds its j-th sample with seed + j;
        # greedy repeats: the j-th copy seed + j), so a prompt samples the same alone or batched
        params = [self._sampling_params(sampling, per_request, (seeds[i] + j) % 2**63)
                  for i in range(len(prompts)) for j in range(reps)]
        if isinstance(adapter, list):
            if len(adapter) != len(prompts):
                raise ValueError(f"{len(adapter)} adapters for {len(prompts)} prompts")
            lora = [self._lora_for(a) for a in adapter for _ in range(reps)]
            lora = None if all(x is None for x in lora) else lora
        else:
            lora = self._lora_for(adapter)
        if watch is None:
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=lora)
            samples = [self._sample(c, sampling) for out in outputs
                       for c in sorted(out.outputs, key=lambda c: c.index)]
        else:  # the engine stepped here: ids to the watch as they come, given-up rows aborted
            from SimpleTorchLLMRL.model.generation.vllm_stream import step_watched

            rows = step_watched(self.llm, requests, params, lora, per_request, watch)
            samples = [self._sample(r.output, sampling) if r.given_up_at is None else self._given_up(r)
                       for r in rows]
        if sampling.grammar is not None:
            self._raw_logprobs([p for p in prompts for _ in range(n)], samples,
                               lora if not isinstance(lora, list) else [x for x in lora for _ in range(per_request)])
        return [samples[i * n: (i + 1) * n] for i in range(len(prompts))]

    def _raw_logprobs(self, prompts: list[list[int]], samples: list[Sample], lora) -> None:
        """Replace each sample's log-probs (vLLM's, after the grammar's mask) with those of the raw logits: one
        prefill of prompt + completion with `prompt_logprobs=0` (computed from the untempered logits)."""
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=list(p) + s.token_ids) for p, s in zip(prompts, samples, strict=True)]
        params = self.vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=lora)
        for p, s, out in zip(prompts, samples, outputs, strict=True):
            rows = out.prompt_logprobs[len(p):]  # one {id: Logprob} per completion token
            s.logprobs = [clamp_logprob(row[tok].logprob) for row, tok in zip(rows, s.token_ids, strict=True)]

    def _sample(self, c, cfg: SamplingConfig) -> Sample:
        ids, logprobs = _ids_and_logprobs(c, len(c.token_ids))
        if c.finish_reason == "stop":
            reason = "tool_call" if c.stop_reason in cfg.tool_call_stop else "stop"
        else:  # "length", or "abort": cut short either way
            reason = "length"
        return Sample(ids, logprobs, reason, c.text)

    def _given_up(self, row) -> Sample:
        """A row the watch gave up (`vllm_stream.RowResult`): the ids it had sampled, finish_reason "length"."""
        if row.output is None:  # aborted before its first step
            return Sample([], [], "length", "")
        ids, logprobs = _ids_and_logprobs(row.output, row.given_up_at)
        return Sample(ids, logprobs, "length", self.tokenizer.decode(ids, skip_special_tokens=True))

    def push_weights(self, model, mode: str = "merged", adapter: str | list[str] | None = None) -> None:
        """mode "merged"/"full": load (merged) weights into the engine; "adapter": serve the peft adapter via LoRA;
        adapter (mode "adapter" only): named adapters, each served under its own `lora_requests[name]`."""
        if model is None:
            raise ValueError("push_weights needs the training model whose weights to copy")
        if adapter is not None:
            if mode != "adapter":
                raise ValueError(f"push_weights(adapter=...) needs mode='adapter', got {mode!r}")
            for name in [adapter] if isinstance(adapter, str) else adapter:
                self.lora_requests[name] = self._push_adapter(model, name)
                self._check(model, self.lora_requests[name], name)
        elif mode == "adapter":
            self.lora_request = self._push_adapter(model)
            self._check(model, self.lora_request)
        elif mode in ("merged", "full"):
            push_weights(self.llm, model)
            self._check(model, None)
        else:
            raise ValueError(f"mode must be 'merged', 'full' or 'adapter', got {mode!r}")

    def _check(self, model, lora_request, adapter: str | None = None) -> None:
        """The engine after a push against the trainer on a short probe (`vllm_engine.check_agreement`);
        while the engine sleeps, the trainer's side is kept and compared at `wake_up`."""
        if not self.check_pushes:
            return
        from SimpleTorchLLMRL.model.adapters import use_adapter

        ids = probe_ids(self.tokenizer)
        with use_adapter(model, adapter) if adapter is not None else contextlib.nullcontext(model):
            mine = trainer_probe(model, ids)
        self._pending.append((ids, mine, lora_request))
        self._compare_pending()

    def _compare_pending(self) -> None:
        while self._pending and not self._asleep:
            ids, mine, lora = self._pending.pop(0)
            self.last_agreement = compare_probe(self.llm, ids, mine, lora_request=lora)

    def _push_adapter(self, model, name: str | None = None):
        """Adapter `name` (None: "default") to a fresh directory, served as a LoRARequest with a new id
        (vLLM caches by id)."""
        from vllm.lora.request import LoRARequest

        from SimpleTorchLLMRL.model.generation.weight_sync import export_adapter

        old = self._adapter_dirs.get(name)
        self._adapter_dirs[name] = tempfile.mkdtemp(prefix=f"stllmrl-lora-{name or 'policy'}-")
        path = export_adapter(model, self._adapter_dirs[name], adapter_name=name or "default")
        if old:
            shutil.rmtree(old, ignore_errors=True)
        self._adapter_id += 1
        return LoRARequest(f"{name or 'policy'}-{self._adapter_id}", self._adapter_id, path)

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory for training: level 1 offloads weights to CPU, level 2 discards them."""
        self.llm.sleep(level=level)
        self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate ("weights", "kv_cache", or all); after a level-2 sleep push weights before generating.
        Pushes made while it slept are checked once it is fully awake."""
        self.llm.wake_up(tags=tags)
        self._asleep -= set(tags) if tags else self._asleep
        self._compare_pending()


def _ids_and_logprobs(c, count: int) -> tuple[list[int], list[float]]:
    """The first `count` ids of a `CompletionOutput` and their log-probs (vLLM's, capped at 0)."""
    ids = [int(t) for t in c.token_ids[:count]]
    if c.logprobs is None or len(c.logprobs) < len(ids):
        raise RuntimeError("vLLM returned no per-token log-probs; SamplingParams(logprobs=0) was ignored")
    return ids, [clamp_logprob(c.logprobs[k][tok].logprob) for k, tok in enumerate(ids)]


def load_weights(llm, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load (HF name, tensor) pairs into the engine's model(s) (`vllm_engine.reload_weights`)."""
    reload_weights(llm, weights)


def push_weights(llm, model) -> None:
    """Copy an HF or peft model's weights into a `vllm.LLM` (`weight_sync.vllm_weights`: LoRA merged into new
    tensors; under FSDP2 only rank 0 loads; a 4-bit base is refused)."""
    from SimpleTorchLLMRL.model.generation.weight_sync import vllm_weights

    weights = vllm_weights(model)
    if weights:
        load_weights(llm, weights.items())
