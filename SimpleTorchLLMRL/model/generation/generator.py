"""`ModelGenerate`: batched generation that records what was sampled (docs/generation.md says what every
MODEL message carries, and how seeds make a row the same alone or batched)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt
from SimpleTorchLLMRL.model.generation.sampling import DecodeWatch, Sample, SamplingConfig, default_eos_ids

KINDS = ("auto", "hf", "vllm")
DECODES = ("auto", "default", "fast")
MAX_SEED = 2**63 - 1


def is_vllm_llm(model) -> bool:
    """A `vllm.LLM` (or an object with its interface), told apart without importing vllm."""
    return not isinstance(model, torch.nn.Module) and hasattr(model, "llm_engine") and hasattr(model, "generate")


@dataclass(frozen=True)
class BackendConfig:
    """Which engine samples, and its own options (everything that is not a sampling setting).

    kind: "auto" (vLLM for a `vllm.LLM`, else HF), "hf", or "vllm" (a `vllm.LLM`, or a model path
    `vllm_engine.make_llm` builds the engine from). HF only: decode, "fast" (`fast_decode`), "default"
    (`model.generate`) or "auto" (fast on CUDA where the model allows); batch_size, at most this many
    sequences per decode (None: all). vLLM only: lora_request, the `LoRARequest` every call uses unless it
    names an adapter; vllm_kwargs, engine settings for a model path. docs/generation.md has more.
    """

    kind: str = "auto"
    decode: str = "auto"
    batch_size: int | None = None
    lora_request: object = None
    vllm_kwargs: dict | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"backend kind must be one of {KINDS}, got {self.kind!r}")
        if self.decode not in DECODES:
            raise ValueError(f"decode must be one of {DECODES}, got {self.decode!r}")
        if self.batch_size is not None and (isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int)
                                            or self.batch_size <= 0):
            raise ValueError(f"batch_size must be None or a positive int, got {self.batch_size!r}")

    @staticmethod
    def of(value) -> BackendConfig:
        """`backend=` as a BackendConfig: one as it is, or a kind ("auto", "hf", "vllm")."""
        if isinstance(value, BackendConfig):
            return value
        if isinstance(value, str):
            return BackendConfig(kind=value)
        raise TypeError(f"backend must be one of {KINDS} or a BackendConfig, got {type(value).__name__}")


def _sampling_config(sampling: SamplingConfig | None, given: dict) -> SamplingConfig:
    """The generator's own SamplingConfig: a copy of `sampling=`, or one from the keywords (`given`), never
    both (a keyword that differs from its default is an error)."""
    if sampling is None:
        return SamplingConfig(**given)
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingConfig)} | {"tool_call_stop": None}
    both = sorted(k for k, v in given.items() if v != defaults[k])
    if both:
        raise ValueError(f"ModelGenerate got sampling= and also {both}; put them in the SamplingConfig")
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    return dataclasses.replace(sampling)  # ModelGenerate fills in eos_token_ids; the caller's object stays


def _per_prompt(value, count: int, name: str, check) -> list:
    """`value` as one entry per prompt: a list as it is (its length checked), else `value` repeated."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts; give one per prompt")
        out = list(value)
    else:
        out = [value] * count
    for v in out:
        check(v)
    return out


def _check_adapter(a) -> None:
    if a is not None and (not isinstance(a, str) or not a):
        raise ValueError(f"adapter names must be non-empty strs (or None), got {a!r}")


def _check_seed(s) -> None:
    if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEED):
        raise ValueError(f"seed must be None or an int in [0, 2**63 - 1], got {s!r}")


class ModelGenerate:
    """Generate MODEL turns for rollouts (or raw token-id prompts) with an HF model or a `vllm.LLM`.

        gen = ModelGenerate(model, tokenizer, max_new_tokens=128, temperature=0.8,
                            tool_call_stop="</tool_call>", seed=0)
        gen.batch_rollout_generate_response(rollouts)        # appends one MODEL message to each (the seed API)
        groups = gen.generate(rollouts, n=8)                 # list[list[Message]], 8 per rollout
        gen.generate(rollouts, adapter="solver")             # with one agent's LoRA adapter (model/adapters.py)

    model: an HF causal LM (peft models too), a `vllm.LLM`, or with a vLLM backend a model path.
    max_new_tokens, temperature, tool_call_stop (stop strings ending a turn with finish_reason "tool_call"):
    the common options; every other one lives in `sampling`, a `SamplingConfig` given instead of those
    three. backend: a kind ("auto", "hf", "vllm") or a `BackendConfig`. seed: the generator's sequence of
    seeds. `policy_version` (0 at first) is stamped on every sampled message (docs/rollouts.md).
    """

    def __init__(self, model, tokenizer=None, max_new_tokens: int = 50, temperature: float = 0.7, *,
                 tool_call_stop: str | Sequence[str] | None = None, sampling: SamplingConfig | None = None,
                 backend: str | BackendConfig = "auto", seed: int | None = None):
        self.config = _sampling_config(sampling, dict(max_new_tokens=max_new_tokens, temperature=temperature,
                                                      tool_call_stop=tool_call_stop))
        engine = BackendConfig.of(backend)
        _check_seed(seed)
        use_vllm = engine.kind == "vllm" or (engine.kind == "auto" and is_vllm_llm(model))
        if not use_vllm and tokenizer is None:
            raise ValueError("tokenizer is required for the HF backend")
        self._rng = None if seed is None else torch.Generator().manual_seed(int(seed))
        if use_vllm:
            self.backend = _vllm_backend(model, tokenizer, self.config, engine)
            tokenizer = self.backend.tokenizer
        else:
            from SimpleTorchLLMRL.model.generation.hf_backend import HFBackend

            if engine.lora_request is not None or engine.vllm_kwargs:
                raise ValueError("lora_request / vllm_kwargs only apply to the vLLM backend")
            self.backend = HFBackend(model, tokenizer, self.config, engine.batch_size, decode=engine.decode)
        self.model = getattr(self.backend, "llm", model)  # the engine when built from a model path
        self.tokenizer = tokenizer
        self.policy_version = 0
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

    def prompt_ids(self, rollouts: Sequence[Rollout]) -> list[list[int]]:
        """Each rollout's prompt ids (`encode_prompt` with this generator's tokenizer), to pass to `generate`."""
        return [encode_prompt(r, self.tokenizer) for r in rollouts]

    def fits(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> bool:
        """Whether a prompt of these ids plus `max_new_tokens` (default: the generator's) fits the context."""
        ctx = self.max_context
        return ctx is None or len(prompt_ids) + (max_new_tokens or self.max_new_tokens) <= ctx

    def _check_prompts(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} encodes to an empty prompt; add a message before generating")
            if not self.fits(p, max_new_tokens):
                raise ValueError(
                    f"prompt {i}: it is {len(p)} tokens and max_new_tokens={max_new_tokens}, over the model's "
                    f"context of {self.max_context} tokens; shorten the prompt or lower max_new_tokens")

    def _prompts(self, prompts, prompt_ids) -> list[list[int]]:
        """Every prompt's ids: rollouts encoded (or `prompt_ids`, their encoding, as given), id lists as they are."""
        if prompt_ids is not None:
            if len(prompt_ids) != len(prompts):
                raise ValueError(f"prompt_ids has {len(prompt_ids)} prompts for {len(prompts)} rollouts; give one each")
            if not all(isinstance(p, Rollout) for p in prompts):
                raise TypeError("prompt_ids encodes rollouts; token-id prompts are their own ids")
            return [[int(t) for t in p] for p in prompt_ids]
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, Rollout):
                out.append(encode_prompt(p, self.tokenizer))
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                out.append([int(t) for t in p])
            else:
                raise TypeError(f"prompt {i} is a {type(p).__name__}: give Rollouts or lists of token ids")
        return out

    # -- generation: the one entry point
    def generate(self, prompts: Sequence[Rollout] | Sequence[Sequence[int]], n: int = 1, *,
                 sampling: SamplingConfig | None = None, adapter: str | Sequence[str | None] | None = None,
                 seed: int | Sequence[int | None] | None = None, prompt_ids: Sequence[Sequence[int]] | None = None,
                 watch: DecodeWatch | None = None) -> list[list[Message]]:
        """`n` sampled MODEL messages per prompt, all prompts x n in one batch. Does not append.
        prompts: Rollouts (encoded by `encode_prompt`) or lists of token ids (sampled from as they are).
        prompt_ids: the rollouts already encoded (`prompt_ids()`), so a caller that checked them encodes once.
        sampling: this call's options only (its empty eos_token_ids take the generator's), never stored.
        adapter: a LoRA adapter's name (HF: of a multi-adapter peft model; vLLM: a pushed `LoRARequest`),
        recorded on each message; a list: one per prompt.
        seed: this call's seed, or one per prompt (None: the next of the generator's sequence).
        watch: a `DecodeWatch` (row i * n + j is prompt i's j-th sample). Not reentrant.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        prompts = list(prompts)
        if not prompts:
            return []
        ids = self._prompts(prompts, prompt_ids)
        call = self._call_config(sampling)
        self._check_prompts(ids, call.max_new_tokens)
        adapters = _per_prompt(adapter, len(ids), "adapter", _check_adapter)
        seeds = [s if s is not None else self._next_seed()
                 for s in _per_prompt(seed, len(ids), "seed", _check_seed)]
        if all(a is None for a in adapters) or self.backend.mixed_adapters:
            return self._sample(ids, n, adapters, seeds, call, watch)
        out: list[list[Message] | None] = [None] * len(ids)
        for name in dict.fromkeys(adapters):  # one batch per adapter (peft activates one at a time)
            rows = [i for i, a in enumerate(adapters) if a == name]
            part = None if watch is None else watch.select([i * n + j for i in rows for j in range(n)])
            got = self._sample([ids[i] for i in rows], n, [name] * len(rows), [seeds[i] for i in rows], call, part)
            for i, msgs in zip(rows, got, strict=True):
                out[i] = msgs
        return out

    def _next_seed(self) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self._rng))

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

    def _sample(self, prompts: list[list[int]], n: int, adapters: list[str | None], seeds: list[int],
                sampling: SamplingConfig, watch: DecodeWatch | None) -> list[list[Message]]:
        extra = {} if watch is None else {"watch": watch}  # only passed when set (backends without it)
        if any(a is not None for a in adapters):  # one name, or one per prompt where the backend mixes them
            extra["adapter"] = adapters if self.backend.mixed_adapters else adapters[0]
        samples = self.backend.generate(prompts, n, seeds, sampling=sampling, **extra)  # len(prompts) x n Samples
        temperature = self.backend.logprob_temperature_for(sampling)
        changes = sampling.distribution_changes()  # what the draw differed by from softmax(logits / T)
        return [[self._message(s, temperature, a, changes) for s in group]
                for group, a in zip(samples, adapters, strict=True)]

    def _message(self, s: Sample, temperature: float, adapter: str | None, changes: dict | None) -> Message:
        return Message(s.text, MessageType.MODEL, token_ids=s.token_ids, logprobs=s.logprobs,
                       finish_reason=s.finish_reason, temperature=temperature,
                       policy_version=self.policy_version, adapter=adapter,
                       sampling=None if changes is None else dict(changes))

    # -- the seed API, over `generate`
    def rollout_generate_response(self, rollout: Rollout, *, adapter: str | None = None) -> Message:
        """One MODEL message for `rollout` (not appended)."""
        return self.generate([rollout], adapter=adapter)[0][0]

    def batch_rollout_generate_response(self, rollouts: Sequence[Rollout], *,
                                        adapter: str | Sequence[str | None] | None = None,
                                        prompt_ids: Sequence[Sequence[int]] | None = None) -> None:
        """Append one MODEL message to each rollout, generated as one batch (prompt_ids: as in `generate`)."""
        for r, msgs in zip(rollouts, self.generate(rollouts, adapter=adapter, prompt_ids=prompt_ids), strict=True):
            r.add_messages(msgs[0])

    # -- weight sync / colocation (no-ops for the HF backend, which generates with the live model)
    def push_weights(self, model=None, mode: str = "merged", *, adapter: str | Sequence[str] | None = None) -> None:
        """Copy a training model's weights into the inference engine (vLLM; HF: nothing to copy) and bump
        `policy_version`. adapter (with mode="adapter"): push these named adapters of a multi-adapter model,
        each served under its own `LoRARequest` (`generate(..., adapter=name)` picks it)."""
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


def extend_groups(rollouts: Sequence[Rollout], groups: Sequence[Sequence[Message]]) -> list[Rollout]:
    """`generate(rollouts, n)`'s groups as copies of each rollout extended by one sample each, flattened
    rollout-major; the copies of one rollout share `metadata["group_id"]` (the rollout's own, else its index)."""
    out = []
    for i, (r, msgs) in enumerate(zip(rollouts, groups, strict=True)):
        for msg in msgs:
            c = r.copy()
            c.metadata.setdefault("group_id", i)
            out.append(c.add_messages(msg))
    return out


def _vllm_backend(model, tokenizer, config: SamplingConfig, engine: BackendConfig):
    from SimpleTorchLLMRL.model.generation.vllm import VLLMBackend

    if engine.decode != "auto" or engine.batch_size is not None:
        raise ValueError("decode / batch_size choose the HF backend's decode loop; the vLLM engine has its own")
    return VLLMBackend(model, tokenizer, config, lora_request=engine.lora_request, vllm_kwargs=engine.vllm_kwargs)
