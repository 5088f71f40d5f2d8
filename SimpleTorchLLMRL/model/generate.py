"""`ModelGenerate`: batched generation that records what was sampled.

Legend: B batch (prompts x n samples), L longest prompt, N new tokens, V vocab.

Every MODEL message carries the sampled `token_ids` (EOS / stop token kept),
their `logprobs` under `softmax(logits / temperature)` *before* top-k/top-p
truncation, logit_bias and penalties (the quantity a trainer recomputes), the
`temperature` those log-probs are under, `sampling`: what else changed the
distribution the turn was drawn from (`SamplingConfig.distribution_changes`,
None when nothing did), and a `finish_reason` ("stop", "length", "tool_call").
Prompts always come from `encode_prompt`, so prompt ids + sampled ids are a
prefix of `encode_rollout` of the extended rollout.

Greedy decoding (`do_sample=False`) records log-probs at the configured
temperature; `temperature=0` means greedy with log-probs at temperature 1.

Backends share one small interface (`sampling.Backend`): the HF one is in
`model/generation/hf_backend.py`, the vLLM one in `model/generation/vllm.py`; both import their shared
types from `model/generation/sampling.py`, never from here.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig, default_eos_ids
from SimpleTorchLLMRL.model.generation.watch import DecodeWatch
from SimpleTorchLLMRL.utils.warn import warn_user

if TYPE_CHECKING:
    from SimpleTorchLLMRL.model.generation.sampling import Sample

BACKENDS = ("auto", "hf", "vllm")
_WARNED: set[str] = set()  # deprecated spellings already reported in this process
_MOVED = {"Sample": "SimpleTorchLLMRL.model.generation.sampling",
          "cut_sample": "SimpleTorchLLMRL.model.generation.sampling"}


def __getattr__(name: str):
    """Names an earlier release kept here resolve from their module, with a DeprecationWarning naming it."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warn_user(f"{__name__}.{name} is deprecated; use `from {_MOVED[name]} import {name}`", DeprecationWarning)
    return getattr(importlib.import_module(_MOVED[name]), name)


def _deprecated(old: str, new: str) -> None:
    if old not in _WARNED:
        _WARNED.add(old)
        warn_user(f"ModelGenerate.{old} is deprecated; use {new}", DeprecationWarning)


def is_vllm_llm(model) -> bool:
    """A `vllm.LLM` (or an object with its interface), told apart without importing vllm."""
    return not isinstance(model, torch.nn.Module) and hasattr(model, "llm_engine") and hasattr(model, "generate")


def _per_rollout(adapter, count: int) -> list[str | None] | None:
    """`adapter` as one entry per rollout (None when no adapter is asked for at all)."""
    if adapter is None:
        return None
    if isinstance(adapter, str):
        adapters = [adapter] * count
    else:
        adapters = list(adapter)
        if len(adapters) != count:
            raise ValueError(f"adapter has {len(adapters)} entries for {count} rollouts; give one per rollout")
    bad = [a for a in adapters if a is not None and (not isinstance(a, str) or not a)]
    if bad:
        raise ValueError(f"adapter names must be non-empty strs (or None), got {bad[0]!r}")
    return None if all(a is None for a in adapters) else adapters


def _sampling_config(sampling: SamplingConfig | None, given: dict) -> SamplingConfig:
    """The generator's own SamplingConfig: a copy of `sampling=`, or one from the sampling keywords
    (`given`), never both (a keyword that differs from `ModelGenerate`'s default is an error)."""
    if sampling is None:
        eos = given["eos_token_ids"]
        if eos is not None and len(eos) == 0:
            raise ValueError("eos_token_ids must be None (tokenizer/model defaults) or a non-empty list of ids")
        return SamplingConfig(**{**given, "eos_token_ids": tuple(eos or ())})
    defaults = inspect.signature(ModelGenerate.__init__).parameters
    both = sorted(k for k, v in given.items() if v != defaults[k].default)
    if both:
        raise ValueError(f"ModelGenerate got sampling= and also {both}; put them in the SamplingConfig")
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    return dataclasses.replace(sampling)  # ModelGenerate fills in eos_token_ids; the caller's object stays


def _messages_key(rollout: Rollout) -> tuple:
    """What a prompt is encoded from: the rollout's messages, by identity and content."""
    return tuple((id(m), m.content) for m in rollout.messages)


class ModelGenerate:
    """Generate MODEL turns for rollouts with an HF model or a `vllm.LLM`.

        gen = ModelGenerate(model, tokenizer, max_new_tokens=128, temperature=0.8, stop=["</answer>"], seed=0)
        gen.batch_rollout_generate_response(rollouts)        # appends one MODEL message to each
        groups = gen.generate(rollouts, n=8)                 # list[list[Message]], 8 per rollout
        gen.generate(rollouts, adapter="solver")             # with one agent's LoRA adapter (model/adapters.py)

    model: an HF causal LM (peft models too), a `vllm.LLM`, or with `backend="vllm"` a model path.
    sampling: the sampling options as one `SamplingConfig` (max_new_tokens, temperature, do_sample,
    top_p, top_k, min_p, stop, tool_call_stop, eos_token_ids; logit_bias, frequency_penalty, presence_penalty
    and grammar (EBNF every completion must match, `model/generation/constrain.py`) only there); the others are also
    keyword arguments (give one or the other). min_p: keep the tokens whose probability is >= min_p times the
    top one's (0 disables; vLLM's and HF's min_p). stop: stop strings (kept in text and ids); tool_call_stop: stop strings that end the turn with
    finish_reason "tool_call" (e.g. "</tool_call>"). eos_token_ids: ids that end a turn (default:
    tokenizer EOS + model generation-config EOS). seed: makes the sequence of calls reproducible.
    batch_size: HF backend only, at most this many sequences per `generate` call (None: all at
    once); vLLM schedules its own batches. policy_version: stamped on every sampled message; bump it
    after each optimizer step (the HF backend samples with the live model), `push_weights` bumps it.
    decode: HF backend only: "fast" (a static KV cache; on GPUs a compiled forward and the decode step
    as a CUDA graph; `fast_decode`), "default" (`model.generate`), "auto" (fast on CUDA where the
    model allows, else default). Both give the same ids under the same seed; a call with a grammar
    always runs the default loop.
    """

    def __init__(self, model, tokenizer=None, max_new_tokens: int = 50, temperature: float = 0.7,
                 do_sample: bool = True, top_p: float | None = None, top_k: int | None = None,
                 stop: str | Sequence[str] | None = None, *, tool_call_stop: str | Sequence[str] | None = None,
                 eos_token_ids: Sequence[int] | None = None, seed: int | None = None,
                 batch_size: int | None = None, backend: str = "auto", lora_request=None,
                 vllm_kwargs: dict | None = None, policy_version: int = 0, sampling: SamplingConfig | None = None,
                 decode: str = "auto", min_p: float = 0.0):
        self.config = _sampling_config(sampling, dict(
            max_new_tokens=max_new_tokens, temperature=temperature, do_sample=do_sample, top_p=top_p, top_k=top_k,
            min_p=min_p, stop=stop, tool_call_stop=tool_call_stop, eos_token_ids=eos_token_ids))
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size <= 0):
            raise ValueError(f"batch_size must be None or a positive int, got {batch_size!r}")
        use_vllm = backend == "vllm" or (backend == "auto" and is_vllm_llm(model))
        if not use_vllm and tokenizer is None:
            raise ValueError("tokenizer is required for the HF backend")
        self._rng = None if seed is None else torch.Generator().manual_seed(int(seed))
        if use_vllm:
            from SimpleTorchLLMRL.model.generation.vllm import VLLMBackend

            if decode != "auto":
                raise ValueError(f"decode={decode!r} chooses the HF backend's decode loop; the vLLM engine has its own")
            self.backend = VLLMBackend(model, tokenizer, self.config, lora_request=lora_request,
                                       vllm_kwargs=vllm_kwargs)
            tokenizer = self.backend.tokenizer
        else:
            from SimpleTorchLLMRL.model.generation.hf_backend import HFBackend

            if lora_request is not None or vllm_kwargs:
                raise ValueError("lora_request / vllm_kwargs only apply to the vLLM backend")
            self.backend = HFBackend(model, tokenizer, self.config, batch_size, decode=decode)
        self.model = getattr(self.backend, "llm", model)  # the engine when built from a model path
        self.tokenizer = tokenizer
        self._fitted: dict[int, tuple[object, int, list[int]]] = {}  # id(rollout) -> prompt ids `fits` encoded
        self.policy_version = int(policy_version)
        if not self.config.eos_token_ids:
            self.config.eos_token_ids = default_eos_ids(tokenizer, getattr(self.backend, "model", None))

    # -- configuration passthroughs (the seed API exposed them as attributes)
    @property
    def temperature(self) -> float:
        return self.config.temperature

    @property
    def max_new_tokens(self) -> int:
        return self.config.max_new_tokens

    @property
    def max_context(self) -> int | None:
        """Tokens the model can attend to (prompt + generation), None when unknown."""
        return self.backend.max_context

    # -- prompts
    def prompt_ids(self, rollouts: Sequence[Rollout]) -> list[list[int]]:
        """Each rollout's prompt ids; a prompt that `fits` just encoded (same rollout, same messages) is reused."""
        out = []
        for r in rollouts:
            seen = self._fitted.pop(id(r), None)
            fresh = seen is not None and seen[0] is r and seen[1] == _messages_key(r)
            out.append(seen[2] if fresh else encode_prompt(r, self.tokenizer))
        self._fitted.clear()
        return out

    def fits(self, rollout: Rollout) -> bool:
        """Whether the rollout's prompt plus `max_new_tokens` fits the model's context.

        The encoded prompt is kept for the next `generate` of this rollout, so a turn's prompt
        is encoded once."""
        ctx = self.max_context
        if ctx is None:
            return True
        ids = encode_prompt(rollout, self.tokenizer)
        self._fitted[id(rollout)] = (rollout, _messages_key(rollout), ids)
        return len(ids) + self.max_new_tokens <= ctx

    def _check_prompts(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        ctx = self.max_context
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"rollout {i} encodes to an empty prompt; add a message before generating")
            if ctx is not None and len(p) + max_new_tokens > ctx:
                raise ValueError(
                    f"rollout {i}: its prompt is {len(p)} tokens and max_new_tokens={max_new_tokens}, "
                    f"over the model's context of {ctx} tokens; shorten the rollout or lower max_new_tokens"
                )

    # -- generation
    def generate(self, rollouts: Sequence[Rollout], n: int = 1, *,
                 adapter: str | Sequence[str | None] | None = None, sampling: SamplingConfig | None = None,
                 seed: int | None = None, prompt_ids: Sequence[Sequence[int]] | None = None,
                 watch: DecodeWatch | None = None) -> list[list[Message]]:
        """`n` sampled MODEL messages per rollout, all prompts x n in one batch. Does not append.

        adapter: sample with this LoRA adapter of a multi-adapter peft model (HF) or with the
        `LoRARequest` pushed under this name (vLLM: `push_weights(model, "adapter", adapter=...)`),
        and record it on each message; a list gives one adapter per rollout (None: as configured).
        The HF backend runs one batch per adapter, in order of first appearance; vLLM one batch.
        sampling: other sampling options for this call only (its empty eos_token_ids take the
        generator's): an argument passed down to the backend, never stored, so `config` stays the
        defaults while the call runs and other threads reading it see the defaults.
        seed: this call's seed instead of the next one of the generator's sequence.
        prompt_ids: the rollouts' prompts already encoded with `chat.tokenize.encode_prompt` (one list
        per rollout; the gateway encodes each prompt once), sampled from as they are.
        watch: a `DecodeWatch` that receives each row's ids as they are sampled (streaming) and may
        cancel rows (row i * n + j is rollout i's j-th sample; `model/generation/watch.py`).
        Calls are not reentrant: one generation at a time per generator.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if prompt_ids is not None and len(prompt_ids) != len(rollouts):
            raise ValueError(f"prompt_ids has {len(prompt_ids)} prompts for {len(rollouts)} rollouts; give one each")
        return self._generate(rollouts, n, adapter, seed, self._call_config(sampling), prompt_ids, watch)

    def generate_from_ids(self, prompts: Sequence[Sequence[int]], n: int = 1, *,
                          sampling: SamplingConfig | None = None, seed: int | None = None,
                          watch: DecodeWatch | None = None) -> list[list[Message]]:
        """`generate` for prompts already encoded (e.g. raw text tokenized without a chat template, as
        the gateway's /v1/completions does): `n` MODEL messages per prompt, sampled from exactly these ids."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        prompts = [[int(t) for t in p] for p in prompts]
        if not prompts:
            return []
        call = self._call_config(sampling)
        self._check_prompts(prompts, call.max_new_tokens)
        return self._sample(prompts, n, None, [None] * len(prompts), seed, call, watch)

    def _call_config(self, sampling: SamplingConfig | None) -> SamplingConfig:
        """This call's settings: the defaults, or `sampling` with the defaults' EOS ids where it has none
        (refused early when the backend cannot record its log-probs, e.g. vLLM's log-probs mode)."""
        if sampling is None:
            return self.config
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        call = dataclasses.replace(sampling, eos_token_ids=sampling.eos_token_ids or self.config.eos_token_ids)
        self.backend.check_sampling(call)  # vLLM: its log-probs mode must fit the call
        return call

    def _generate(self, rollouts, n: int, adapter, seed: int | None, sampling: SamplingConfig,
                  prompt_ids=None, watch: DecodeWatch | None = None) -> list[list[Message]]:
        rollouts = list(rollouts)
        if not rollouts:
            return []
        for i, r in enumerate(rollouts):
            if not isinstance(r, Rollout):
                raise TypeError(f"rollout {i} is a {type(r).__name__}, not a Rollout")
        if prompt_ids is None:
            prompts = self.prompt_ids(rollouts)
        else:
            prompts = [[int(t) for t in p] for p in prompt_ids]
        self._check_prompts(prompts, sampling.max_new_tokens)
        adapters = _per_rollout(adapter, len(rollouts))
        if adapters is None:
            return self._sample(prompts, n, None, [None] * len(prompts), seed, sampling, watch)
        if self.backend.mixed_adapters:  # vLLM: one LoRARequest per prompt, one batch
            return self._sample(prompts, n, adapters, adapters, seed, sampling, watch)
        out: list[list[Message] | None] = [None] * len(prompts)
        for name in dict.fromkeys(adapters):  # one batch per adapter
            rows = [i for i, a in enumerate(adapters) if a == name]
            part = None if watch is None else watch.select([i * n + j for i in rows for j in range(n)])
            for i, msgs in zip(rows, self._sample([prompts[i] for i in rows], n, name, [name] * len(rows), seed,
                                                  sampling, part), strict=True):
                out[i] = msgs
        return out

    def _sample(self, prompts, n, adapter, recorded, seed: int | None, sampling: SamplingConfig,
                watch: DecodeWatch | None = None) -> list[list[Message]]:
        if seed is None and self._rng is not None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        extra = {} if watch is None else {"watch": watch}  # only passed when set (backends without it)
        if adapter is None:
            samples = self.backend.generate(prompts, n, seed, sampling=sampling, **extra)  # len(prompts) x n Samples
        else:
            samples = self.backend.generate(prompts, n, seed, sampling=sampling, adapter=adapter, **extra)
        temperature = self.backend.logprob_temperature_for(sampling)
        changes = sampling.distribution_changes()  # what the draw differed by from softmax(logits / T)
        return [[self._message(s, temperature, a, changes) for s in group]
                for group, a in zip(samples, recorded, strict=True)]

    def _message(self, s: Sample, temperature: float, adapter: str | None = None,
                 changes: dict | None = None) -> Message:
        return Message(s.text, MessageType.MODEL, token_ids=s.token_ids, logprobs=s.logprobs,
                       finish_reason=s.finish_reason, temperature=temperature,
                       policy_version=self.policy_version, adapter=adapter,
                       sampling=None if changes is None else dict(changes))

    def rollout_generate_response(self, rollout: Rollout, *, adapter: str | None = None) -> Message:
        """One MODEL message for `rollout` (not appended)."""
        return self.generate([rollout], adapter=adapter)[0][0]

    def responses(self, rollouts: Sequence[Rollout], *,
                  adapter: str | Sequence[str | None] | None = None) -> list[Message]:
        """Deprecated: `[m[0] for m in generate(rollouts)]`."""
        _deprecated("responses", "generate(rollouts), one list of messages per rollout")
        return [msgs[0] for msgs in self.generate(rollouts, adapter=adapter)]

    def batch_rollout_generate_response(self, rollouts: Sequence[Rollout], *,
                                        adapter: str | Sequence[str | None] | None = None) -> None:
        """Append one MODEL message to each rollout, generated as one batch."""
        for r, msgs in zip(rollouts, self.generate(rollouts, adapter=adapter), strict=True):
            r.add_messages(msgs[0])

    def group_generate(self, rollouts: Sequence[Rollout], n: int, *,
                       adapter: str | Sequence[str | None] | None = None) -> list[list[Message]]:
        """Deprecated: `generate(rollouts, n)`."""
        _deprecated("group_generate", "generate(rollouts, n)")
        return self.generate(rollouts, n, adapter=adapter)

    def group_rollout_generate_response(self, rollouts: Sequence[Rollout], n: int, *,
                                        adapter: str | Sequence[str | None] | None = None) -> list[Rollout]:
        """`n` copies of each rollout, each extended by its own sample, flattened rollout-major.

        Copies share `metadata["group_id"]` (the rollout's own, else its index here).
        """
        out = []
        for i, (r, msgs) in enumerate(zip(rollouts, self.generate(rollouts, n, adapter=adapter), strict=True)):
            for msg in msgs:
                c = r.copy()
                c.metadata.setdefault("group_id", i)
                out.append(c.add_messages(msg))
        return out

    # -- weight sync / colocation (no-ops for the HF backend, which generates with the live model)
    def push_weights(self, model=None, mode: str = "merged", *, adapter: str | Sequence[str] | None = None) -> None:
        """Copy a training model's weights into the inference engine (vLLM; HF: nothing to copy) and bump
        `policy_version`: the messages sampled next come from the new weights.

        adapter (with mode="adapter"): push these named adapters of a multi-adapter model, each
        served under its own `LoRARequest` (`generate(..., adapter=name)` picks it)."""
        if adapter is None:
            self.backend.push_weights(model, mode)
        else:
            if mode != "adapter":
                raise ValueError(f"push_weights(adapter={adapter!r}) needs mode='adapter', got mode={mode!r}")
            self.backend.push_weights(model, mode, adapter=adapter)
        self.policy_version += 1

    def sleep(self, level: int = 1) -> None:
        self.backend.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.backend.wake_up(tags)
