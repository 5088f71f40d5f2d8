"""Small helpers `main.py` uses around its loop, which it runs itself: step seeds and rows (`batch_at`: a
function of the position only, so a resumed run sees exactly the rows an uninterrupted one would), the
sampler, each step's episode stats, the metrics log, files, the run lock. The steps every loop shares are
the library's (`utils.training`, `utils.checkpoint`).
"""

from __future__ import annotations

import copy
import fcntl
import functools
import json
import os
import random
import signal
import socket
import sys
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from SimpleTorchLLMRL.chat.message import MessageType, Rollout
from SimpleTorchLLMRL.model.generation.generator import BackendConfig, ModelGenerate
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
from SimpleTorchLLMRL.recipes.calculator.arithmetic import used_tool
from SimpleTorchLLMRL.recipes.calculator.cli import UsageError
from SimpleTorchLLMRL.utils.jsonl import read_jsonl

ROLLOUT_STREAM, EVAL_STREAM = 0, 1
LOCK_NAME = ".lock"  # in --output-dir while a run holds it


def step_seed(seed: int, step: int, stream: int = ROLLOUT_STREAM) -> int:
    """The sampling seed of one step: a function of (seed, step) only, so a resumed run resamples the same."""
    return (seed * 1_000_003 + step * 2 + stream) % 2**62


@functools.lru_cache(maxsize=4)
def epoch_order(n: int, epoch: int, seed: int) -> tuple[int, ...]:
    """A permutation of range(n), fixed by (seed, epoch)."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


def batch_at(rows: list[dict], position: int, batch_size: int, seed: int) -> list[dict]:
    """`batch_size` rows starting at `position` of the endless seeded order (a new shuffle per epoch)."""
    n = len(rows)
    out = []
    for p in range(position, position + batch_size):
        epoch, i = divmod(p, n)
        out.append(rows[epoch_order(n, epoch, seed)[i]])
    return out


class Sampler:
    """Builds each step's `ModelGenerate` (HF: with the training model itself). With `--backend vllm` it owns
    the run's one engine; `sync(model)` after each optimizer step pushes the weights (merged LoRA for --lora,
    the adapter for --qlora)."""

    def __init__(self, model, tokenizer, *, stop_strings, max_new_tokens: int, temperature: float,
                 backend: str = "hf", model_name: str | None = None, adapter: bool = False,
                 dtype: str | None = None, engine_kwargs: dict | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.stop_strings, self.max_new_tokens, self.temperature = stop_strings, max_new_tokens, temperature
        self.adapter = adapter
        self.engine = None
        self.lora_request = None
        if backend == "vllm":  # settings from one place (model/generation/vllm_engine.py); engine_kwargs win
            from SimpleTorchLLMRL.model.generation.vllm_engine import make_llm

            self.engine = make_llm(model_name, temperature=temperature, dtype=dtype,
                                   **{"enable_lora": adapter, **(engine_kwargs or {})})
            self.sync(model)

    def generator(self, seed: int, greedy: bool = False, policy_version: int = 0, model=None) -> ModelGenerate:
        """model: sample with these weights instead (the async producer's copy)."""
        lora = self.lora_request if self.engine is not None else None
        engine = self.engine if self.engine is not None else (model if model is not None else self.model)
        gen = ModelGenerate(engine, self.tokenizer, seed=seed, backend=BackendConfig(lora_request=lora),
                            sampling=SamplingConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                                    do_sample=not greedy, tool_call_stop=self.stop_strings))
        gen.policy_version = policy_version
        return gen

    def sync(self, model) -> None:
        """Push the training weights into the vLLM engine (no-op for HF)."""
        if self.engine is None:
            return
        gen = self.generator(seed=0)
        gen.push_weights(model, mode="adapter" if self.adapter else "merged")
        if self.adapter:
            self.lora_request = gen.backend.lora_request


def episode_stats(rollouts: Sequence[Rollout], rewards: torch.Tensor) -> dict[str, float]:
    """Accuracy (reward == 1), tool-use rate, and sampled tokens per rollout."""
    n = max(len(rollouts), 1)
    sampled = [sum(len(m.token_ids or ()) for m in r if m.type is MessageType.MODEL) for r in rollouts]
    return {"accuracy": float((rewards >= 1.0).float().mean()) if len(rollouts) else 0.0,
            "tool_rate": sum(map(used_tool, rollouts)) / n,
            "tokens": sum(sampled) / n}


def trim_metrics(path: Path, last_step: int) -> None:
    """Drop rows after `last_step` from a metrics.jsonl (a resumed run rewrites them), atomically."""
    if not path.exists():
        return
    kept = [json.dumps(row) for row in read_jsonl(path, torn_tail="skip") if row.get("step", 0) <= last_step]
    write_atomic(path, "".join(s + "\n" for s in kept))


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class BackgroundEval:
    """Held-out evaluations on a copy of the weights, in a worker thread, so training goes on (async mode).
    evaluate_at(step, model) -> (report, rollouts). `finished()` hands back completed evaluations in step
    order; `finished(wait=True)` waits for all of them."""

    def __init__(self, model, evaluate_at):
        self.copy = copy.deepcopy(model).eval()
        self.evaluate_at = evaluate_at
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="held-out-eval")
        self.pending: deque = deque()

    def submit(self, step: int, model) -> None:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # the weights of this step

        def job():
            self.copy.load_state_dict(state)
            return self.evaluate_at(step, self.copy)

        self.pending.append((step, self.pool.submit(job)))

    def finished(self, wait: bool = False) -> list[tuple[int, dict, list]]:
        out = []
        while self.pending and (wait or self.pending[0][1].done()):
            step, future = self.pending.popleft()
            out.append((step, *future.result()))
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class StopOnSignal:
    """SIGTERM / SIGINT during the loop: the first asks it to stop at the next step boundary, the second
    stops the process at once (the signal's default action). The previous handlers come back on exit;
    from a thread other than the main one (which alone may set handlers) this does nothing.

        with StopOnSignal() as stop:
            for step in steps:
                ...                                   # the step runs to its end
                if stop.requested: save a checkpoint; break
        return stop.exit_status                       # 128 + the signal: 143 for SIGTERM, 130 for SIGINT
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, prog: str = "main.py"):
        self.prog = prog
        self.signum: int | None = None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_status(self) -> int:
        return 128 + (self.signum or 0)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # the second signal: stop now (checkpoints and final/ are atomic)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        print(f"\n{self.prog}: {signal.Signals(signum).name}: stopping after this step and saving a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


class RunLock:
    """One run at a time in an output dir: an exclusive flock on `out/.lock`, held until `release`.

        with RunLock() as lock:
            lock.acquire(out)   # UsageError naming the other run's PID when one holds it; idempotent
            ...                 # the run
                                # released (and the file removed) on exit

    The file holds the holder's PID and host. A file left by a killed run holds no lock (the kernel
    drops it with the process) and is taken over.
    """

    def __init__(self):
        self.path: Path | None = None
        self.fd: int | None = None

    def acquire(self, out: Path) -> None:
        if self.fd is not None:
            return
        path = out / LOCK_NAME
        try:
            out.mkdir(parents=True, exist_ok=True)
            while True:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _lock_holder(fd)
                    os.close(fd)
                    raise UsageError(f"--output-dir {out} is in use by another run ({holder}); wait for it to end "
                                     "or choose another --output-dir") from None
                except OSError:
                    os.close(fd)
                    raise
                if _names(path, fd):
                    break
                os.close(fd)  # the run that held it removed the file as we opened it: lock the new one
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        except OSError as e:
            raise UsageError(f"--output-dir {out}: cannot lock {path}: {e.strerror or e}") from e
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if _names(self.path, self.fd):
                os.unlink(self.path)  # before the lock goes: a run that opened it now sees another file
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _names(path: Path, fd: int) -> bool:
    """Whether `path` is still the file open as `fd`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _lock_holder(fd: int) -> str:
    """ "pid N" (and "on HOST" when it is another machine) from a lock file's contents."""
    words = os.pread(fd, 256, 0).decode("utf-8", "replace").split()
    if not words:
        return "pid unknown"
    host = f" on {words[1]}" if len(words) > 1 and words[1] != socket.gethostname() else ""
    return f"pid {words[0]}{host}"
