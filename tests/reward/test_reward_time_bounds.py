r"""Issue 16, items 11 and 12: every math reward call is bounded on any thread; text rewards are linear."""

import sys
import threading
import time

import pytest

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.reward import BoxedReward, ExactMatch, TokenF1, math_verify_available
from SimpleTorchLLMRL.reward.math_verify_pool import MathVerifyPool

BOUND_S = 20.0


def rollout(text):
    return Rollout([Message("question"), Message(text, MessageType.MODEL)])


def in_worker_thread(fn):
    """fn()'s result and seconds, run on a non-main thread (where SIGALRM timeouts cannot work)."""
    out = {}

    def run():
        start = time.perf_counter()
        out["value"] = fn()
        out["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S * 3)
    assert not thread.is_alive(), "the reward call is still running"
    return out["value"], out["seconds"]


PATHOLOGICAL = [r"\boxed{9^{9^{9}}}", r"\boxed{9^9^9}", r"\boxed{999999999^{999999999}}", r"\boxed{(10^{100})!}",
                r"\boxed{10^{10^{10}}}", r"\boxed{\sum_{k=1}^{10^{10}} k}"]


@pytest.mark.parametrize("mode", [False, pytest.param(None, marks=pytest.mark.skipif(
    not math_verify_available(), reason="math-verify not installed"))])
@pytest.mark.parametrize("gold", ["1", r"\sqrt{2}"])  # a number (rules decide) and an expression (math-verify decides)
def test_pathological_answers_are_bounded_off_the_main_thread(gold, mode):
    reward = BoxedReward(use_math_verify=mode)
    for answer in PATHOLOGICAL:
        value, seconds = in_worker_thread(lambda answer=answer: reward([rollout(answer)], [gold]).item())
        assert value == 0.0 and seconds < BOUND_S, (answer, seconds)


def test_a_worker_that_overruns_is_killed_and_replaced():
    # A stand-in worker: says it is ready, then answers "1" instantly and sleeps on anything else.
    script = ("import json,sys,time\nprint(json.dumps({'ready': True}), flush=True)\nfor line in sys.stdin:\n"
              "    q = json.loads(line)\n    time.sleep(0 if q['pred'] == '1' else 60)\n"
              "    print(json.dumps({'verdict': True}), flush=True)\n")
    pool = MathVerifyPool(command=[sys.executable, "-c", script])
    try:
        assert pool.ask("1", "1", timeout=5.0) is True
        verdict, seconds = in_worker_thread(lambda: pool.ask("1", "slow", timeout=1.0))
        assert verdict is None and 1.0 <= seconds < 3.0
        assert pool.ask("1", "1", timeout=5.0) is True  # its replacement answers
    finally:
        pool.close()


def test_a_worker_that_dies_gives_no_verdict():
    pool = MathVerifyPool(command=[sys.executable, "-c", "print('{\"ready\": true}', flush=True)"])
    try:
        assert pool.ask("1", "1", timeout=2.0) is None
    finally:
        pool.close()


@pytest.mark.skipif(not math_verify_available(), reason="math-verify not installed")
def test_ordinary_answers_stay_fast():
    reward = BoxedReward()
    reward([rollout(r"\boxed{2\sqrt{2}}")], [r"\sqrt{8}"])  # starts the worker
    pairs = [(r"\boxed{72}", "72"), (r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
             (r"\boxed{\pi/2}", r"\frac{\pi}{2}"), (r"\boxed{x+1}", "1+x")]
    start = time.perf_counter()
    for _ in range(10):
        assert reward([rollout(p) for p, _ in pairs], [g for _, g in pairs]).tolist() == [1.0] * 5
    assert (time.perf_counter() - start) / 50 < 0.05  # about 1 ms per call on a quiet machine


@pytest.mark.parametrize("cls", [ExactMatch, TokenF1])
def test_text_rewards_take_linear_time(cls):
    reward = cls(extract=r"<answer>(.*?)</answer>")
    times = {}
    for kb in (25, 100):
        text = "<answer>" * (kb * 1000 // 8)  # every OPEN unclosed: a regex retries from each to the end
        start = time.perf_counter()
        assert reward([rollout(text + "<answer>Paris</answer>")], ["Paris"]).item() == 0.0
        assert reward([rollout("<answer>x</answer>" + text)], ["x"]).item() == 1.0
        times[kb] = time.perf_counter() - start
    assert times[100] < 0.5  # was 5-23 s


@pytest.mark.parametrize("pattern", [r"<answer>(.*?)</answer>", r"\[ANS\](.+?)\[/ANS\]", r"<a>([\s\S]*?)</a>"])
def test_linear_extract_finds_what_the_regex_finds(pattern):
    import random
    import re

    from SimpleTorchLLMRL.reward import make_extractor

    extract, regex, rng = make_extractor(pattern), re.compile(pattern, re.DOTALL), random.Random(0)
    pieces = ["<answer>", "</answer>", "<a>", "</a>", "[ANS]", "[/ANS]", "y", "\n", ""]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
        matches = list(regex.finditer(text))
        assert extract(text) == ((matches[-1].group(1)) if matches else None), text
