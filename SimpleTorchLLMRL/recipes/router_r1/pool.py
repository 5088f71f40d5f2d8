"""The routing pool: candidate LLMs by name, each with a price, answering sub-questions.

    pool = RoutingPool([
        CallableModel("calc", lambda q: str(eval_arith(q)), cost_per_call=0.001),
        HFModel("qwen-7b", path="Qwen/Qwen2.5-7B-Instruct", price_per_1m_tokens=0.3),   # loaded on first call
        OpenAIModel("llama-70b", "meta/llama-3.1-70b-instruct", api_base="https://.../v1",
                    api_key_env="ROUTER_API_KEY", price_per_1m_tokens=0.88),
    ])
    results = pool.route([("calc", "2 + 3"), ("LLAMA-70B", "capital of France?")])   # never raises
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from SimpleTorchLLMRL.recipes.router_r1.config import AGENT_PROMPT, RouterToolConfig

STATUSES = ("ok", "error", "unknown_model")


@dataclass
class RouteResult:
    """One routed call: the reply text (or the error), tokens it cost, its price and status."""

    name: str
    query: str
    text: str
    completion_tokens: int = 0
    cost: float = 0.0
    status: str = "ok"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class RoutedModel:
    """Base: a named candidate with a price. Subclasses implement `complete(prompts) -> [(text, tokens)]`."""

    batched = False  # True: `complete` takes all of a round's prompts at once

    def __init__(self, name: str, *, description: str = "", price_per_1m_tokens: float = 0.0,
                 cost_per_call: float = 0.0, agent_prompt: str | None = None):
        if not isinstance(name, str) or not name.strip() or ":" in name:
            raise ValueError(f"a routed model name must be a non-empty string without ':', got {name!r}")
        for arg, v in (("price_per_1m_tokens", price_per_1m_tokens), ("cost_per_call", cost_per_call)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{arg} of {name!r} must be a number >= 0, got {v!r}")
        if agent_prompt is not None and "{query}" not in agent_prompt:
            raise ValueError(f"agent_prompt of {name!r} needs a {{query}} placeholder")
        self.name, self.description = name.strip(), description
        self.price_per_1m_tokens, self.cost_per_call = float(price_per_1m_tokens), float(cost_per_call)
        self.agent_prompt = agent_prompt

    def cost(self, completion_tokens: int) -> float:
        return self.cost_per_call + completion_tokens * self.price_per_1m_tokens / 1e6

    def complete(self, prompts: list[str]) -> list[tuple[str, int]]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class CallableModel(RoutedModel):
    """Any Python callable `fn(prompt) -> str | (str, completion_tokens)`; tokens default to words.
    raw_query=True (default) passes the policy's query itself instead of the agent prompt around it."""

    def __init__(self, name: str, fn: Callable[[str], str | tuple[str, int]], *, raw_query: bool = True, **kw):
        if not callable(fn):
            raise TypeError(f"CallableModel {name!r}: fn must be callable, got {type(fn).__name__}")
        super().__init__(name, **kw)
        self.fn, self.raw_query = fn, raw_query

    def complete(self, prompts):
        out = self.fn(prompts[0])
        text, tokens = out if isinstance(out, tuple) else (out, None)
        text = str(text)
        return [(text, len(text.split()) if tokens is None else int(tokens))]


class LocalGenerator:
    """One HF model + tokenizer behind a `ModelGenerate`, shared by HFModels: `path` (loaded on first use with
    `from_pretrained`) or a ready `model` and `tokenizer`. Calls are serialized by a lock; each is one batch."""

    def __init__(self, path: str | None = None, *, model=None, tokenizer=None, max_new_tokens: int = 512,
                 temperature: float = 0.0, device: str | None = None, dtype: str = "auto"):
        if (path is None) == (model is None):
            raise ValueError("LocalGenerator needs exactly one of path= or model= (with tokenizer=)")
        if model is not None and tokenizer is None:
            raise ValueError("LocalGenerator(model=...) also needs tokenizer=")
        self.path, self.device, self.dtype = path, device, dtype
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self._model, self._tokenizer, self._generator = model, tokenizer, None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._generator is not None

    def _load(self):
        from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
        from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig

        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
            self._tokenizer = AutoTokenizer.from_pretrained(self.path)
            self._model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype).to(device).eval()
        if self._tokenizer.pad_token_id is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token
        greedy = self.temperature == 0
        self._generator = ModelGenerate(self._model, self._tokenizer,
                                        sampling=SamplingConfig(max_new_tokens=self.max_new_tokens,
                                                                temperature=self.temperature,
                                                                do_sample=not greedy))

    def generate(self, prompts: list[str]) -> list[tuple[str, int]]:
        from SimpleTorchLLMRL.chat.message import Message, Rollout

        with self._lock:
            if self._generator is None:
                self._load()
            msgs = self._generator.generate([Rollout([Message(p)]) for p in prompts])
        out = []
        for (m,) in msgs:
            n = len(m.token_ids or [])
            if m.token_ids and m.token_ids[-1] in self._generator.config.eos_token_ids:
                n -= 1  # the end-of-turn token is not part of the reply
            out.append((m.content.strip(), n))
        return out


class HFModel(RoutedModel):
    """A local HF causal LM. `path=` loads lazily; pass `generator=` to share one `LocalGenerator`."""

    batched = True

    def __init__(self, name: str, path: str | None = None, *, generator: LocalGenerator | None = None,
                 max_new_tokens: int = 512, temperature: float = 0.0, device: str | None = None,
                 dtype: str = "auto", **kw):
        super().__init__(name, **kw)
        if (path is None) == (generator is None):
            raise ValueError(f"HFModel {name!r} needs exactly one of path= or generator=")
        self.generator = generator or LocalGenerator(path, max_new_tokens=max_new_tokens, temperature=temperature,
                                                     device=device, dtype=dtype)

    def complete(self, prompts):
        return self.generator.generate(list(prompts))


class OpenAIModel(RoutedModel):
    """An OpenAI-compatible `/chat/completions` endpoint over urllib; the key comes from `api_key_env`."""

    def __init__(self, name: str, model_id: str, *, api_base: str, api_key_env: str | None = "ROUTER_API_KEY",
                 timeout: float = 60.0, max_retries: int = 2, max_tokens: int = 512, temperature: float = 0.0,
                 retry_wait: float = 1.0, **kw):
        super().__init__(name, **kw)
        cfg = RouterToolConfig(api_base=api_base, api_key_env=api_key_env, request_timeout=timeout,
                               max_retries=max_retries, routed_max_tokens=max_tokens, routed_temperature=temperature)
        self.model_id, self.url = model_id, cfg.api_base.rstrip("/") + "/chat/completions"
        self.api_key_env, self.timeout, self.max_retries = cfg.api_key_env, cfg.request_timeout, cfg.max_retries
        self.max_tokens, self.temperature, self.retry_wait = cfg.routed_max_tokens, cfg.routed_temperature, retry_wait

    @classmethod
    def from_config(cls, name: str, model_id: str, tool: RouterToolConfig, **kw) -> OpenAIModel:
        """An endpoint model with `tool.api_base`, `api_key_env`, timeout, retries, max tokens and temperature."""
        if tool.api_base is None:
            raise ValueError("tool.api_base is None; set it to the OpenAI-compatible server's URL (…/v1)")
        return cls(name, model_id, api_base=tool.api_base, api_key_env=tool.api_key_env,
                   timeout=tool.request_timeout, max_retries=tool.max_retries, max_tokens=tool.routed_max_tokens,
                   temperature=tool.routed_temperature, **kw)

    def _request(self, prompt: str) -> urllib.request.Request:
        body = {"model": self.model_id, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.max_tokens, "temperature": self.temperature}
        headers = {"Content-Type": "application/json"}
        if self.api_key_env is not None:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise RuntimeError(f"the environment variable {self.api_key_env} (the API key) is not set")
            headers["Authorization"] = f"Bearer {key}"
        return urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")

    def complete(self, prompts):
        request = self._request(prompts[0])
        for attempt in range(self.max_retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as resp:
                    data = json.loads(resp.read().decode("utf-8"))
                break
            except urllib.error.HTTPError as e:  # 4xx other than 429 will not get better by retrying
                if attempt == self.max_retries or (e.code < 500 and e.code != 429):
                    raise RuntimeError(f"HTTP {e.code} from {self.url}: {e.read()[:200]!r}") from None
            except (urllib.error.URLError, TimeoutError, OSError) as e:
                if attempt == self.max_retries:
                    raise RuntimeError(f"request to {self.url} failed: {e}") from None
            time.sleep(self.retry_wait * 2**attempt)
        try:
            text = data["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise RuntimeError(f"unexpected response from {self.url}: {str(data)[:200]}") from None
        tokens = (data.get("usage") or {}).get("completion_tokens")
        return [(text, len(text.split()) if tokens is None else int(tokens))]


class RoutingPool:
    """Candidate models by case-insensitive name. `route` answers many (name, query) pairs at once."""

    def __init__(self, models: Iterable[RoutedModel] = (), *, agent_prompt: str = AGENT_PROMPT, max_workers: int = 10):
        self._models: dict[str, RoutedModel] = {}
        if "{query}" not in agent_prompt:
            raise ValueError("RoutingPool agent_prompt needs a {query} placeholder")
        self.agent_prompt, self.max_workers = agent_prompt, max_workers
        for m in models:
            self.add(m)

    @classmethod
    def from_config(cls, models: Iterable[RoutedModel], tool: RouterToolConfig) -> RoutingPool:
        return cls(models, agent_prompt=tool.agent_prompt, max_workers=tool.max_workers)

    def add(self, model: RoutedModel) -> RoutingPool:
        if not isinstance(model, RoutedModel):
            raise TypeError(f"pool members must be RoutedModel objects, got {type(model).__name__}")
        key = model.name.lower()
        if key in self._models:
            raise ValueError(f"the pool already has a model named {model.name!r}")
        self._models[key] = model
        return self

    @property
    def names(self) -> list[str]:
        return [m.name for m in self._models.values()]

    def get(self, name: str) -> RoutedModel | None:
        return self._models.get(name.strip().lower())

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None

    def __len__(self) -> int:
        return len(self._models)

    def describe(self) -> str:
        """One block per model for the policy's prompt: `name: description`."""
        return "\n".join(f"{m.name}: {m.description}".rstrip(": ") for m in self._models.values())

    def prompt_for(self, model: RoutedModel, query: str) -> str:
        if isinstance(model, CallableModel) and model.raw_query:
            return query
        return (model.agent_prompt or self.agent_prompt).format(query=query)

    def route(self, requests: Sequence[tuple[str, str]]) -> list[RouteResult]:
        """Results aligned with `requests`; never raises for an unknown name or a failing model."""
        results: list[RouteResult | None] = [None] * len(requests)
        by_model: dict[str, list[int]] = {}
        for i, (name, query) in enumerate(requests):
            model = self.get(name)
            if model is None:
                results[i] = RouteResult(name, query, f"unknown model {name.strip()!r}; available: "
                                         + ", ".join(self.names), status="unknown_model")
            else:
                by_model.setdefault(model.name, []).append(i)
        jobs = []  # (model, [request indices]) — one job per batched model, one per call otherwise
        for name, idx in by_model.items():
            model = self._models[name.lower()]
            jobs += [(model, idx)] if model.batched else [(model, [i]) for i in idx]
        if jobs:
            workers = max(1, min(self.max_workers, len(jobs)))
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="route") as ex:
                runs = ex.map(lambda job: self._run(job[0], job[1], requests), jobs)
                for (_, idx), res in zip(jobs, runs, strict=True):
                    for i, r in zip(idx, res, strict=True):
                        results[i] = r
        return results  # type: ignore[return-value]

    def _run(self, model: RoutedModel, idx: list[int], requests) -> list[RouteResult]:
        queries = [requests[i][1] for i in idx]
        try:
            outs = model.complete([self.prompt_for(model, q) for q in queries])
            if len(outs) != len(queries):
                raise RuntimeError(f"{len(outs)} replies for {len(queries)} queries")
        except Exception as e:  # noqa: BLE001  (a failing model is data for the policy, not a crash)
            return [RouteResult(model.name, q, f"{model.name} failed: {type(e).__name__}: {e}", status="error")
                    for q in queries]
        return [RouteResult(model.name, q, text, tokens, model.cost(tokens))
                for q, (text, tokens) in zip(queries, outs, strict=True)]
