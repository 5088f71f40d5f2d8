"""Asynchronous generation with bounded staleness: a producer thread fills a queue the trainer drains.

    queue = RolloutQueue(max_staleness=1)
    producer = AsyncProducer(lambda step, version: collect_rollouts(make_generator(version), env, ...),
                             queue, steps=range(1, steps + 1), apply=lambda sd: sampler_model.load_state_dict(sd))
    producer.start()
    for step in range(1, steps + 1):
        rollouts = queue.get(current_version=step - 1)      # never older than max_staleness versions
        ... loss.backward(); optimizer.step()
        producer.publish(model.state_dict(), version=step)  # applied between two producer batches
    producer.stop()

Step s's batch is sampled by exactly version max(0, s - 1 - max_staleness) (`sampling_version`): no thread
timing, so a run resumes exactly (`in_flight` / `history=`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from SimpleTorchLLMRL.chat.message import Rollout, sampled_versions


def oldest_version(rollouts: list[Rollout]) -> int | None:
    """The smallest policy version among the batch's sampled messages (None if none is recorded)."""
    versions = sampled_versions(rollouts)
    return min(versions) if versions else None


class RolloutQueue:
    """Batches of rollouts between a producer and the trainer, at most `max_staleness` versions old."""

    def __init__(self, max_staleness: int, stale: str = "drop", maxsize: int | None = None):
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        if stale not in ("drop", "keep"):
            raise ValueError(f"stale must be 'drop' or 'keep', got {stale!r}")
        self.max_staleness, self.stale = max_staleness, stale
        self.maxsize = max(1, max_staleness) if maxsize is None else maxsize
        self._items: deque = deque()
        self._cond = threading.Condition()
        self.dropped = 0  # batches dropped for staleness
        self.closed = False
        self.error: BaseException | None = None

    def put(self, batch: list[Rollout]) -> bool:
        """Add a batch, waiting while the queue is full; False if the queue was closed meanwhile."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._items) < self.maxsize or self.closed)
            if self.closed:
                return False
            self._items.append(batch)
            self._cond.notify_all()
            return True

    def get(self, current_version: int, timeout: float | None = None) -> list[Rollout]:
        """The next batch no more than `max_staleness` versions behind `current_version`.

        Too-old batches are dropped (counted in `dropped`) unless `stale="keep"`. Raises the
        producer's exception if it failed, TimeoutError after `timeout` seconds, EOFError when
        the producer is finished and nothing is left.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                while self._items:
                    batch = self._items.popleft()
                    self._cond.notify_all()
                    oldest = oldest_version(batch)
                    if self.stale == "drop" and oldest is not None and current_version - oldest > self.max_staleness:
                        self.dropped += 1
                        continue
                    return batch
                if self.error is not None:
                    raise RuntimeError("the rollout producer failed") from self.error
                if self.closed:
                    raise EOFError("the rollout producer has finished")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("no rollouts arrived in time")
                self._cond.wait(left)

    def close(self, error: BaseException | None = None) -> None:
        with self._cond:
            self.closed = True
            self.error = error
            self._cond.notify_all()


def sampling_version(step: int, max_staleness: int) -> int:
    """The version that samples step `step`'s batch (trained at version step - 1): exactly max_staleness behind."""
    return max(0, step - 1 - max_staleness)


def versions_after(version: int, max_staleness: int) -> set[int]:
    """The versions that sample the batches in flight after step `version`: what a checkpoint there needs."""
    return {sampling_version(step, max_staleness) for step in range(version + 1, version + 2 + max_staleness)}


class AsyncProducer:
    """Calls `produce(step, version) -> rollouts` for each step in a background thread, into a queue.

    apply: installs published weights in the producer's sampler (e.g. `copy_model.load_state_dict`);
    it runs in the producer thread, between batches. version: the version the sampler holds at the
    start (and the newest one published). history: {version: state_dict} of earlier versions the
    first batches need (a resumed run: what `in_flight` returned when its checkpoint was saved).
    """

    def __init__(self, produce: Callable[[int, int], list[Rollout]], queue: RolloutQueue, steps: Iterable[int],
                 apply: Callable[[dict], None] | None = None, version: int = 0, history: dict | None = None):
        self.produce, self.queue, self.steps, self.apply = produce, queue, list(steps), apply
        self.version = version
        self._published = version  # the newest version the trainer has published
        self._weights: dict[int, dict] = dict(history or {})  # published versions still to be sampled by
        self._lock = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self.busy_seconds = 0.0  # time spent producing (for overlap measurements)

    def start(self) -> AsyncProducer:
        self._thread.start()
        return self

    def publish(self, state_dict: dict, version: int) -> None:
        """Hand over new weights (copied now, on the caller's thread); batches sampled by them follow."""
        staged = {k: v.detach().clone() for k, v in state_dict.items()}
        with self._lock:
            self._weights[version] = staged
            self._published = version
            for v in [v for v in self._weights if v < version - self.queue.max_staleness]:
                del self._weights[v]  # no later batch is sampled by it (nor kept by a checkpoint)
            self._lock.notify_all()

    def in_flight(self, version: int) -> dict[int, dict]:
        """{v: state_dict} of the versions below `version` that the batches after step `version` are
        sampled by: what a checkpoint at `version` keeps so the resumed run samples the same."""
        needed = versions_after(version, self.queue.max_staleness)
        with self._lock:
            return {v: self._weights[v] for v in sorted(needed) if v < version and v in self._weights}

    def _take_weights(self, needed: int) -> None:
        """Install exactly version `needed` (already published)."""
        with self._lock:
            staged = self._weights.get(needed)
        if needed != self.version:
            if staged is None:
                raise RuntimeError(f"the producer needs the weights of version {needed}, which were never published "
                                   "(a resumed run needs AsyncProducer(history=...) from its checkpoint)")
            if self.apply is not None:
                self.apply(staged)
            self.version = needed

    def _wait_for_version(self, needed: int) -> bool:
        """Block until the trainer has published `needed` (False if the queue closed meanwhile)."""
        with self._lock:
            while self._published < needed and not self.queue.closed:
                self._lock.wait(0.1)
            return not self.queue.closed

    def _run(self) -> None:
        try:
            for step in self.steps:
                # step s trains at version s - 1: sample it with exactly max_staleness versions behind
                needed = sampling_version(step, self.queue.max_staleness)
                if not self._wait_for_version(needed):
                    return
                self._take_weights(needed)
                t0 = time.perf_counter()
                batch = self.produce(step, self.version)
                self.busy_seconds += time.perf_counter() - t0
                if not self.queue.put(batch):
                    return
            self.queue.close()
        except BaseException as e:  # surfaced to the trainer by queue.get
            self.queue.close(error=e)

    def stop(self, timeout: float | None = 10.0) -> None:
        self.queue.close()
        self._thread.join(timeout)
