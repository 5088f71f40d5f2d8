"""The adaptive batch window: simultaneous requests share one batch, and requests that arrive while a batch
generates form the next batch together. A fake generator for the batcher's own rules, the embedded model over
HTTP (127.0.0.1) for 32 simultaneous sessions."""

import asyncio
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from SimpleTorchLLMRL import ModelGenerate  # noqa: E402
from SimpleTorchLLMRL.chat.message import Message, MessageType  # noqa: E402
from SimpleTorchLLMRL.gateway import Gateway  # noqa: E402
from SimpleTorchLLMRL.gateway.batcher import Batcher, Job  # noqa: E402
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig  # noqa: E402
from tests.support.gateway_helpers import load_calc, start  # noqa: E402


class FakeGenerator:
    """Answers each rollout with one message after `seconds`; records the size of each call."""

    def __init__(self, seconds: float = 0.0):
        self.seconds, self.calls = seconds, []

    def generate(self, prompts, n, *, sampling, seed, watch=None):
        self.calls.append(len(prompts))
        time.sleep(self.seconds)
        return [[Message("ok", MessageType.MODEL)] * n for _ in prompts]


def job() -> Job:
    return Job([1, 2, 3], SamplingConfig(), 1, None)


async def staggered(batcher: Batcher, count: int, gap: float, prepare: float) -> None:
    """`count` requests starting `gap` seconds apart, each `prepare` seconds in preparation before it is queued."""
    async def one(k: int):
        await asyncio.sleep(k * gap)
        with batcher.expect():
            await asyncio.sleep(prepare)
            queued = batcher.enqueue(job())
        return await queued.future

    await asyncio.gather(*[one(k) for k in range(count)])


def run_batcher(fn, generator, **kw) -> Batcher:
    batcher = Batcher(generator, **kw)

    async def main():
        batcher.start()
        try:
            await fn(batcher)
        finally:
            await batcher.stop()

    asyncio.run(main())
    return batcher


def test_requests_arriving_over_more_than_the_window_still_share_a_batch():
    """32 requests, one every 8 ms, each 15 ms in preparation: spread over 270 ms, never 20 ms apart. A fixed
    window from the first arrival would cut them into several batches."""
    gen = FakeGenerator()
    batcher = run_batcher(lambda b: staggered(b, 32, 0.008, 0.015), gen, window=0.02, max_wait=1.0)
    assert list(batcher.batches) == [32] and gen.calls == [32]


def test_arrivals_during_a_generation_form_the_next_batch_at_once():
    """The first request waits its 0.2 s window, then generates for 0.3 s; ten arrive meanwhile. They form the
    next batch as soon as the first ends, with no window of their own (that would add 0.2 s)."""
    gen = FakeGenerator(seconds=0.3)
    took = {}

    async def fn(b: Batcher):
        first = asyncio.ensure_future(staggered(b, 1, 0, 0))
        await asyncio.sleep(0.3)  # the first batch generates now (from 0.2 s to 0.5 s)
        t0 = time.perf_counter()
        await staggered(b, 10, 0.005, 0)
        took["s"] = time.perf_counter() - t0  # about 0.2 s waiting + 0.3 s generating
        await first

    batcher = run_batcher(fn, gen, window=0.2)
    assert list(batcher.batches) == [1, 10]
    assert took["s"] < 0.65


def test_a_lone_request_waits_only_the_window():
    gen = FakeGenerator()
    took = {}

    async def fn(b: Batcher):
        t0 = time.perf_counter()
        await staggered(b, 1, 0, 0)
        took["s"] = time.perf_counter() - t0

    run_batcher(fn, gen, window=0.05, max_wait=5.0)
    assert 0.04 < took["s"] < 1.0


def test_32_simultaneous_sessions_form_one_batch_of_32():
    model, tok = load_calc()
    gw = Gateway(ModelGenerate(model, tok, max_new_tokens=4, temperature=1.0, seed=0))
    barrier = threading.Barrier(32)
    codes: list[int] = []
    with gw.serve() as url:
        clients = [httpx.Client(timeout=120) for _ in range(32)]
        for c in clients:  # connected before the race starts
            assert c.get(f"{url.removesuffix('/v1')}/health").status_code == 200

        def call(k: int) -> None:
            barrier.wait()
            r = clients[k].post(f"{url}/chat/completions", json={"model": "policy", "messages": start(f"{k} + 1?")},
                                headers={"Authorization": f"Bearer s{k}"})
            codes.append(r.status_code)

        threads = [threading.Thread(target=call, args=(k,)) for k in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for c in clients:
            c.close()
    assert codes == [200] * 32
    assert list(gw.batcher.batches) == [32]
    assert len(gw.sessions()) == 32
