"""A CPU stand-in for the documented `vllm` API surface (v0.11+ / 0.32), backed by a tiny HF model.

Implements what `SimpleTorchLLMRL.model.generation.vllm` touches, with vLLM's semantics:

- `LLM(model_path, *, tokenizer=None, seed=0, logprobs_mode="raw_logprobs", enable_sleep_mode=False,
  enable_lora=False, max_lora_rank=16, max_model_len=None, **engine_kwargs)`
- `LLM.generate(prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, ...)` ->
  `list[RequestOutput]` in prompt order; prompts are `TokensPrompt` dicts or strings.
- `SamplingParams` fields and validation (temperature in [0, 2], 0 = greedy and then n must be 1,
  top_k 0/-1 disables, top_p in (0, 1], max_tokens >= 1, stop str -> [str], logprobs >= 0 or -1).
- Sampling order: logit_bias, frequency / presence penalties (over the completion's tokens), then
  temperature, then top-k, then top-p. `logprobs_mode`: "raw_logprobs" is log_softmax(logits), before
  all of them; "processed_logprobs" is taken after them all; greedy requests use untempered (but
  biased, penalized) logits for the latter (vLLM's all-greedy path).
- `CompletionOutput(index, text, token_ids, cumulative_logprob, logprobs, finish_reason, stop_reason)`,
  logprobs a list (one per sampled token) of dict[token_id -> Logprob(logprob, rank, decoded_token)].
  EOS: finish "stop", stop_reason None, EOS id kept in token_ids. stop_token_ids: stop_reason = the id.
  Stop strings: checked on the detokenized text, token_ids keep the completing token, text cut at
  (or, with include_stop_str_in_output, right after) the stop string, stop_reason = the string.
- Parallel sampling: the j-th of n samples of a request with seed s uses seed s + j.
- `LoRARequest(lora_name, lora_int_id, lora_path)`: the adapter is loaded from lora_path (peft format)
  over the current base weights; requires `enable_lora=True`.
- `LLM.apply_model(func)` / `collective_rpc(method_name or callable, kwargs=...)` / the worker's
  `reload_weights(weights_iterator=..., is_checkpoint_format=True)` / `llm_engine.model_executor.
  driver_worker` (present in-process only): a model whose `load_weights(weights)` takes HF
  checkpoint names and raises KeyError on any other name and ValueError on a shape mismatch.
  The real engine is tested in tests/model/test_vllm_real.py; this fake stays for what a CPU engine
  cannot show (CUDA-only behaviour such as sleep levels, and fast unit tests).
- Stepped requests, as `LLM.generate` runs them inside vLLM: `LLM._preprocess_cmpl(prompts)`,
  `LLM.request_counter`, `llm_engine.add_request(request_id, prompt, params, lora_request=None)` (returns an
  internal id; a request of n > 1 samples has children f"{j}_{internal id}"), `llm_engine.step()` (one more
  id per unfinished sample, as `RequestOutputKind.CUMULATIVE` outputs), `llm_engine.abort_request(ids,
  internal=False)`, `llm_engine.has_unfinished_requests()`. Each request is sampled whole when added
  (exactly what `generate` samples for it) and handed out one id per step.
- `sleep(level)` (needs `enable_sleep_mode=True`; level 2 discards weights) / `wake_up(tags)`;
  generating while asleep raises. `reset_prefix_cache()`.
"""

from __future__ import annotations

import copy
import enum
import itertools
import math
import sys
import types
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

__version__ = "0.32.0"


class VLLMValidationError(ValueError):
    pass


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        if 0 < self.temperature < 1e-2:
            self.temperature = 1e-2
        self.stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        if not isinstance(self.n, int) or self.n < 1:
            raise VLLMValidationError(f"n must be at least 1, got {self.n}.")
        if not 0.0 <= self.temperature <= 2.0:
            raise VLLMValidationError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise VLLMValidationError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise VLLMValidationError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise VLLMValidationError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise VLLMValidationError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
        if any(not s for s in self.stop):
            raise VLLMValidationError("stop cannot contain an empty string.")
        if self.temperature < 1e-5:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise VLLMValidationError(f"n must be 1 when using greedy sampling, got {self.n}.")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: LoRARequest | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput:
    def __init__(self, request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished,
                 lora_request=None, **kwargs):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.prompt_logprobs, self.outputs, self.finished = prompt_logprobs, outputs, finished
        self.lora_request = lora_request


# ----------------------------------------------------------------------------- the engine's model


class FakeVllmModel(torch.nn.Module):
    """What a worker's model_runner.model offers: `load_weights` over HF checkpoint names."""

    def __init__(self, hf_model, engine):
        super().__init__()
        self.hf = hf_model
        self._engine = engine
        self.load_calls = 0

    def load_weights(self, weights) -> set[str]:
        if "weights" in self._engine.asleep:
            raise RuntimeError("cannot load weights while the engine's weights are asleep; wake_up(['weights']) first")
        params = dict(self.hf.named_parameters())
        tied = bool(getattr(self.hf.config, "tie_word_embeddings", False))
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and tied:
                continue  # vLLM skips the tied head
            if name not in params:
                raise KeyError(name)
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(tensor.to(params[name].dtype))
            loaded.add(name)
        self.load_calls += 1
        return loaded


class _Worker:
    def __init__(self, model):
        self.model_runner = types.SimpleNamespace(model=model)
        self.reload_calls = 0

    def apply_model(self, func):
        return func(self.model_runner.model)

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        """vLLM's layer-wise in-place reload (Worker.reload_weights): HF checkpoint names, every layer."""
        if not is_checkpoint_format or weights_iterator is None:
            raise NotImplementedError("the fake reloads checkpoint-format weights from an iterator only")
        self.reload_calls += 1
        return self.model_runner.model.load_weights(weights_iterator)


class _Engine:
    def __init__(self, llm, model_config, worker):
        self._llm = llm
        self.model_config = model_config
        self.vllm_config = types.SimpleNamespace(model_config=model_config, lora_config=llm._lora_config)
        self._live: dict[str, list] = {}  # stepped samples: internal id -> [external id, output, sample, shown]
        self._ids = itertools.count()
        self._worker = worker  # workers live in other processes unless the engine runs in-process:
        self.model_executor = types.SimpleNamespace(driver_worker=types.SimpleNamespace(worker=worker))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        worker = self._worker
        fn = getattr(worker, method) if isinstance(method, str) else (lambda *a, **k: method(worker, *a, **k))
        return [fn(*args, **(kwargs or {}))]

    def apply_model(self, func):
        return self.collective_rpc("apply_model", args=(func,))

    def reset_prefix_cache(self, *args):
        self._llm.prefix_cache_resets += 1
        return True

    # -- stepped requests (CUMULATIVE outputs, one id per step)
    def add_request(self, request_id: str, prompt, params, lora_request=None, **kwargs) -> str:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id)}")
        out = self._llm._request(request_id, prompt, params, lora_request)
        internal = f"{request_id}-{next(self._ids):08x}"
        for c in out.outputs:
            child = internal if len(out.outputs) == 1 else f"{c.index}_{internal}"
            self._live[child] = [request_id, out, c, 0]  # external id, whole output, its sample, ids handed out
        return internal

    def step(self) -> list[RequestOutput]:
        by_request: dict[str, RequestOutput] = {}
        for child, state in list(self._live.items()):
            request_id, whole, c, shown = state
            state[3] = shown = shown + 1
            ended = shown >= len(c.token_ids)
            text = c.text if ended else self._llm._tokenizer.decode(c.token_ids[:shown], skip_special_tokens=True)
            part = CompletionOutput(c.index, text, c.token_ids[:shown], None,
                                    None if c.logprobs is None else c.logprobs[:shown],
                                    c.finish_reason if ended else None, c.stop_reason if ended else None,
                                    c.lora_request)
            out = by_request.setdefault(request_id, RequestOutput(request_id, None, whole.prompt_token_ids, None, [],
                                                                  False, lora_request=whole.lora_request))
            out.outputs.append(part)
            if ended:
                del self._live[child]
        for out in by_request.values():
            out.finished = not any(s[0] == out.request_id for s in self._live.values())
        return list(by_request.values())

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        for rid in request_ids:
            for child in [c for c, s in self._live.items() if (c == rid if internal else s[0] == rid)]:
                del self._live[child]

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)


# ----------------------------------------------------------------------------- LLM


class LLM:
    def __init__(self, model: str, *, tokenizer: str | None = None, seed: int = 0,
                 logprobs_mode: str = "raw_logprobs", enable_sleep_mode: bool = False,
                 enable_lora: bool = False, max_lora_rank: int = 16, max_model_len: int | None = None,
                 **engine_kwargs: Any):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if logprobs_mode not in ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"):
            raise ValueError(f"unknown logprobs_mode {logprobs_mode!r}")
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self._tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        self._lora_config = types.SimpleNamespace(max_lora_rank=max_lora_rank) if enable_lora else None
        max_model_len = max_model_len or hf.config.max_position_embeddings
        model_config = types.SimpleNamespace(model=model, logprobs_mode=logprobs_mode, max_model_len=max_model_len,
                                             enable_sleep_mode=enable_sleep_mode, seed=seed)
        self.engine_kwargs = engine_kwargs
        self.asleep: set[str] = set()
        self.prefix_cache_resets = 0
        self.generate_calls: list[dict] = []
        self._vllm_model = FakeVllmModel(hf, self)
        self.llm_engine = _Engine(self, model_config, _Worker(self._vllm_model))
        self.model_config = model_config
        self._rng = torch.Generator().manual_seed(seed)
        self._request_counter = 0
        self.request_counter = itertools.count()  # vLLM's ids of stepped requests

    def get_tokenizer(self):
        return self._tokenizer

    # -- public engine controls
    def apply_model(self, func):
        return self.llm_engine.apply_model(func)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1):
        if not self.model_config.enable_sleep_mode:
            raise RuntimeError("Sleep mode is not enabled in the model config (LLM(..., enable_sleep_mode=True))")
        self.reset_prefix_cache()
        if level == 2:
            with torch.no_grad():
                for p in self._vllm_model.hf.parameters():
                    p.zero_()  # level 2 discards the weights: they must be reloaded after wake_up
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None):
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        for t in tags:
            if t not in ("weights", "kv_cache"):
                raise ValueError(f"unknown wake_up tag {t!r}")
            self.asleep.discard(t)

    # -- generation
    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None,
                 tokenization_kwargs=None) -> list[RequestOutput]:
        if self.asleep:
            raise RuntimeError(f"the engine is asleep ({sorted(self.asleep)}); call wake_up() first")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(params) != len(prompts) or len(loras) != len(prompts):
            raise ValueError("sampling_params / lora_request lists must match the prompts in length")
        self.generate_calls.append(dict(n_prompts=len(prompts), lora_request=lora_request))
        outs = []
        for prompt, sp, lora in zip(prompts, params, loras, strict=True):
            rid = str(self._request_counter)
            self._request_counter += 1
            outs.append(self._request(rid, prompt, sp, lora))
        return outs

    def _preprocess_cmpl(self, prompts) -> list:
        """vLLM renders prompts for its engine here; the fake engine takes them as they are."""
        return list(prompts)

    def _request(self, rid: str, prompt, sp, lora) -> RequestOutput:
        """One request run to its end: `sp.n` completions of `prompt`."""
        if self.asleep:
            raise RuntimeError(f"the engine is asleep ({sorted(self.asleep)}); call wake_up() first")
        sp = sp or SamplingParams()
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else self._tokenizer.encode(prompt)
        if len(ids) > self.model_config.max_model_len:
            raise ValueError(f"The decoder prompt (length {len(ids)}) is longer than the maximum model "
                             f"length of {self.model_config.max_model_len}.")
        model = self._model_for(lora)
        completions = [self._complete(model, list(ids), sp, j, lora) for j in range(sp.n)]
        prompt_lp = None if sp.prompt_logprobs is None else self._prompt_logprobs(model, list(ids))
        return RequestOutput(rid, None, list(ids), prompt_lp, completions, True, lora_request=lora)

    def _prompt_logprobs(self, model, ids: list[int]) -> list:
        """vLLM's prompt_logprobs: None for the first token, then {token: Logprob} of each prompt token."""
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        return [None] + [{ids[t]: Logprob(float(lp[t - 1, ids[t]]), 1)} for t in range(1, len(ids))]

    def _model_for(self, lora):
        if lora is None:
            return self._vllm_model.hf
        if self._lora_config is None:
            raise ValueError("LoRA is not enabled! Construct the LLM with enable_lora=True")
        from peft import PeftConfig, PeftModel

        if PeftConfig.from_pretrained(lora.lora_path).r > self._lora_config.max_lora_rank:
            raise ValueError("LoRA rank is greater than max_lora_rank")
        return PeftModel.from_pretrained(copy.deepcopy(self._vllm_model.hf), lora.lora_path).eval()

    def _complete(self, model, prompt: list[int], sp: SamplingParams, index: int, lora) -> CompletionOutput:
        if sp.repetition_penalty != 1.0 or sp.min_p or sp.bad_words or sp.allowed_token_ids or sp.min_tokens:
            raise NotImplementedError("the fake engine implements temperature / top-k / top-p sampling, logit_bias "
                                      "and frequency / presence penalties only")
        greedy = sp.temperature < 1e-5
        gen = torch.Generator().manual_seed(sp.seed + index) if sp.seed is not None else self._rng
        eos = self._tokenizer.eos_token_id
        mode = self.model_config.logprobs_mode
        out_ids: list[int] = []
        logprobs: list[dict[int, Logprob]] | None = [] if sp.logprobs is not None else None
        cumulative, text, finish, stop_reason = 0.0, "", None, None
        past = None
        while finish is None:
            with torch.no_grad():  # one token at a time over a KV cache, like the engine
                step_ids = prompt if past is None else out_ids[-1:]
                res = model(input_ids=torch.tensor([step_ids]), past_key_values=past, use_cache=True)
                past, logits = res.past_key_values, res.logits[0, -1].float()  # (V,)
            raw = torch.log_softmax(logits, -1)
            shifted = _shifted(logits, sp, out_ids)  # bias and penalties, after the raw log-probs
            if greedy:
                tok = int(torch.argmax(shifted))
                processed, processed_logits = torch.log_softmax(shifted, -1), shifted
            else:
                processed_logits = _top_k_top_p(shifted / sp.temperature, sp.top_k, sp.top_p)
                processed = torch.log_softmax(processed_logits, -1)
                tok = int(torch.multinomial(processed.exp(), 1, generator=gen))
            table = {"raw_logprobs": raw, "processed_logprobs": processed, "raw_logits": logits,
                     "processed_logits": processed_logits}[mode]
            out_ids.append(tok)
            cumulative += float(table[tok])
            if logprobs is not None:
                logprobs.append(self._logprob_entry(table, tok, sp.logprobs))
            new_text = self._tokenizer.decode(out_ids, skip_special_tokens=sp.skip_special_tokens)
            new_chars, text = len(new_text) - len(text), new_text
            if not sp.ignore_eos and tok == eos:
                finish = "stop"
            elif tok in sp.stop_token_ids:
                finish, stop_reason = "stop", tok
            elif (hit := _check_stop_strings(text, new_chars, sp.stop, sp.include_stop_str_in_output)) is not None:
                stop_reason, cut = hit
                finish = "stop"
                text = text if cut == -1 else text[:cut]
            elif len(out_ids) >= (sp.max_tokens or math.inf) or \
                    len(prompt) + len(out_ids) >= self.model_config.max_model_len:
                finish = "length"
        return CompletionOutput(index, text, out_ids, cumulative if logprobs is not None else None, logprobs,
                                finish, stop_reason, lora)

    def _logprob_entry(self, table: torch.Tensor, tok: int, k: int) -> dict[int, Logprob]:
        def entry(t):
            return Logprob(float(table[t]), int((table > table[t]).sum()) + 1, self._tokenizer.decode([t]))

        out = {tok: entry(tok)}
        if k:
            top = torch.topk(table, table.numel() if k == -1 else k).indices.tolist()
            out.update({t: entry(t) for t in top if t not in out})
        return out


def _shifted(logits: torch.Tensor, sp: SamplingParams, out_ids: list[int]) -> torch.Tensor:
    """vLLM's order: logits + logit_bias, then - frequency_penalty * count - presence_penalty * (count > 0),
    counted over the completion's own tokens (the prompt is not)."""
    if not (sp.logit_bias or sp.frequency_penalty or sp.presence_penalty):
        return logits
    z = logits.clone()
    for t, b in (sp.logit_bias or {}).items():
        z[int(t)] += b
    counts = torch.bincount(torch.tensor(out_ids, dtype=torch.long), minlength=z.numel()).float()
    return z - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0).float()


def _top_k_top_p(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """vLLM's order: top-k, then top-p over the (sorted ascending) survivors; -inf for the rest."""
    logits = logits.clone()
    if k and k > 0 and k < logits.numel():
        kth = torch.topk(logits, k).values[-1]
        logits[logits < kth] = -math.inf
    if p < 1.0:
        sorted_logits, idx = logits.sort(descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1 - p
        drop[-1] = False
        logits[idx[drop]] = -math.inf
    return logits


def _check_stop_strings(text: str, new_chars: int, stop: list[str], include: bool):
    """vLLM's check: (stop_string, truncate_to or -1) when a stop string shows up in the new text."""
    if not new_chars or not stop:
        return None
    for s in stop:
        at = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if at == -1:
            continue
        if include:
            at += len(s)
            if at >= len(text):
                return s, -1
        return s, at
    return None


# ----------------------------------------------------------------------------- install


def install_fake_vllm(monkeypatch) -> types.ModuleType:
    """Put a fake `vllm` package (vllm, vllm.inputs, vllm.lora.request, vllm.outputs, ...) in sys.modules."""
    this = sys.modules[__name__]

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    vllm = mod("vllm", LLM=LLM, SamplingParams=SamplingParams, TokensPrompt=TokensPrompt,
               RequestOutput=RequestOutput, CompletionOutput=CompletionOutput, __version__=__version__,
               __fake__=this)
    vllm.inputs = mod("vllm.inputs", TokensPrompt=TokensPrompt)
    vllm.sampling_params = mod("vllm.sampling_params", SamplingParams=SamplingParams,
                               RequestOutputKind=RequestOutputKind)
    vllm.outputs = mod("vllm.outputs", RequestOutput=RequestOutput, CompletionOutput=CompletionOutput)
    vllm.logprobs = mod("vllm.logprobs", Logprob=Logprob)
    vllm.lora = mod("vllm.lora")
    vllm.lora.request = mod("vllm.lora.request", LoRARequest=LoRARequest)
    return vllm
