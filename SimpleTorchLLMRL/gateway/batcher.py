"""Requests that arrive together are generated together, one batch at a time on a worker thread, split by
sampling options, each job with its own seed; a failed call is retried job by job, and a cancelled job's rows
stop within a few decode steps (docs/gateway.md, "Batching"). `NamedLocks`: one X-Session-Id's calls in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from SimpleTorchLLMRL.model.generation.sampling import DecodeWatch, SamplingConfig

MAX_RECORDS = 256


@dataclass
class Job:
    """One prompt's n samples: its ids (as encoded), this call's settings, its seed, and for a stream the
    listener and the index of its first choice (`offset`)."""

    prompt_ids: list[int]
    sampling: SamplingConfig
    n: int
    seed: int | None
    listener: object | None = None
    offset: int = 0
    future: asyncio.Future | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """The client left: the rows stop at the next check and the result is dropped."""
        self._cancelled.set()
        if self.future is not None:
            self.future.cancel()

    def key(self) -> str:
        return json.dumps([dataclasses.asdict(self.sampling), self.n], sort_keys=True, default=str)


class Batcher:
    def __init__(self, generator, window: float = 0.02, max_batch: int = 64, max_wait: float | None = None):
        self.generator, self.window, self.max_batch = generator, window, max_batch
        self.max_wait = max(0.25, window) if max_wait is None else max_wait
        self._queue: asyncio.Queue | None = None
        self._changed: asyncio.Event | None = None  # set on every arrival and every preparation that ends
        self._task: asyncio.Task | None = None
        self.preparing = 0  # requests being parsed / encoded, about to be enqueued (`expect`)
        self.batches: deque[int] = deque(maxlen=MAX_RECORDS)  # requests per generated batch, the last ones

    def start(self) -> None:
        self._queue, self._changed = asyncio.Queue(), asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @contextlib.contextmanager
    def expect(self):
        """Around a request's preparation (parsing, encoding) up to its `enqueue`: a batch being formed
        waits for it (at most `max_wait`)."""
        self.preparing += 1
        try:
            yield
        finally:
            self.preparing -= 1
            if self._changed is not None:
                self._changed.set()

    def enqueue(self, job: Job) -> Job:
        """Queue the job; `job.future` gets its n sampled MODEL messages (or what generation raised for it)."""
        job.future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(job)
        self._changed.set()
        return job

    async def _gather(self) -> list[Job]:
        """The next batch: the first request, then what is queued, waiting while it may grow (docs/gateway.md,
        "Batching")."""
        loop = asyncio.get_running_loop()
        batch = [await self._queue.get()]
        idle = self._queue.empty()  # nothing queued behind it: it did not wait for a batch to end
        start = last = loop.time()
        while len(batch) < self.max_batch:
            while not self._queue.empty() and len(batch) < self.max_batch:
                batch.append(self._queue.get_nowait())
                last = loop.time()
            now = loop.time()
            if len(batch) >= self.max_batch or now >= start + self.max_wait:
                break
            if self.preparing:
                until = start + self.max_wait
            elif idle and now < last + self.window:
                until = min(last + self.window, start + self.max_wait)
            else:
                break
            self._changed.clear()
            if not self._queue.empty():
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), until - now)
        return batch

    async def _run(self) -> None:
        while True:
            batch = [job for job in await self._gather() if not job.cancelled]
            if not batch:
                continue
            self.batches.append(len(batch))
            results = await asyncio.to_thread(self._generate, batch)
            for job, result in zip(batch, results, strict=True):
                if job.future.done():
                    continue
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

    def _generate(self, jobs: list[Job]) -> list:
        """One result per job: its messages, or the exception its generation raised."""
        out: list = [None] * len(jobs)
        groups: dict[str, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(job.key(), []).append(i)
        for rows in groups.values():
            try:
                for i, m in zip(rows, self._call([jobs[i] for i in rows]), strict=True):
                    out[i] = m
            except Exception:  # noqa: BLE001  (retried one by one: only the bad request fails)
                for i in rows:
                    if jobs[i].listener is not None:
                        jobs[i].listener.reset()
                    try:
                        out[i] = self._call([jobs[i]])[0]
                    except Exception as e:  # noqa: BLE001  (returned to that request's handler)
                        out[i] = e
        return out

    def _call(self, jobs: list[Job]) -> list[list]:
        """One generate call for jobs of the same key: their prompts as encoded, each with its own seed."""
        first = jobs[0]
        watch = _watch(jobs, first.n)
        return self.generator.generate([j.prompt_ids for j in jobs], first.n, sampling=first.sampling,
                                       seed=[j.seed for j in jobs], **({"watch": watch} if watch else {}))


def _watch(jobs: list[Job], n: int) -> DecodeWatch:
    """The jobs' cancel flags (and a stream's listener) as one `DecodeWatch` over the call's rows (row r:
    job r // n, its sample r % n)."""

    def on_tokens(rows, ids) -> None:
        per_job: dict[int, list] = {}
        for r, new in zip(rows, ids, strict=True):
            if jobs[r // n].listener is not None:
                per_job.setdefault(r // n, []).append((jobs[r // n].offset + r % n, new))
        for k, items in per_job.items():
            jobs[k].listener.push(items)

    streams = any(j.listener is not None for j in jobs)
    return DecodeWatch(on_tokens if streams else None, lambda r: jobs[r // n].cancelled)


class NamedLocks:
    """One asyncio.Lock per name while a call holds or waits for it; dropped when the last one leaves."""

    def __init__(self):
        self._locks: dict[str, list] = {}  # name -> [lock, holders and waiters]

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, name: str) -> AsyncIterator[None]:
        entry = self._locks.setdefault(name, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[name]
