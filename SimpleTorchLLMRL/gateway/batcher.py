"""Requests that arrive together are generated together.

The first request waits `window` seconds for others (at most `max_batch` in all); the batch
is split by sampling options (one `ModelGenerate.generate` call per distinct options, n and
seed) and generated in one worker thread, one batch at a time, while the event loop keeps
accepting requests. A call that fails is retried request by request, so one bad request
fails alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass

from SimpleTorchLLMRL.chat.message import Message, Rollout
from SimpleTorchLLMRL.model.sampling import SamplingConfig


@dataclass
class Job:
    rollout: Rollout | None
    sampling: SamplingConfig
    n: int
    seed: int | None
    prompt_ids: list[int] | None = None  # an encoded prompt (/v1/completions): generated from these ids as they are

    def key(self) -> str:
        return json.dumps([dataclasses.asdict(self.sampling), self.n, self.seed, self.prompt_ids is not None],
                          sort_keys=True, default=str)


class Batcher:
    def __init__(self, generator, window: float = 0.02, max_batch: int = 64):
        self.generator, self.window, self.max_batch = generator, window, max_batch
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self.batches: list[int] = []  # requests per generated batch (for tests and logs)

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def submit(self, job: Job) -> list[Message]:
        """The job's n sampled MODEL messages (raises what generation raised for it)."""
        future = asyncio.get_running_loop().create_future()
        await self._queue.put((job, future))
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + self.window
            while len(batch) < self.max_batch:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), timeout))
                except TimeoutError:
                    break
            batch = [(job, fut) for job, fut in batch if not fut.cancelled()]
            if not batch:
                continue
            self.batches.append(len(batch))
            results = await asyncio.to_thread(self._generate, [job for job, _ in batch])
            for (_, fut), result in zip(batch, results, strict=True):
                if fut.cancelled():
                    continue
                if isinstance(result, BaseException):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)

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
                    try:
                        out[i] = self._call([jobs[i]])[0]
                    except Exception as e:  # noqa: BLE001  (returned to that request's handler)
                        out[i] = e
        return out

    def _call(self, jobs: list[Job]) -> list[list]:
        """One generate call for jobs of the same key: rollouts through the chat template, or encoded ids."""
        first = jobs[0]
        if first.prompt_ids is not None:
            return self.generator.generate_from_ids([j.prompt_ids for j in jobs], first.n, sampling=first.sampling,
                                                    seed=first.seed)
        return self.generator.generate([j.rollout for j in jobs], first.n, sampling=first.sampling, seed=first.seed)
