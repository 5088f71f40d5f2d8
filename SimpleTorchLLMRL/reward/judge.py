"""`JudgeReward`: an LLM judge's verdict on each rollout's final answer, as a reward in [0, 1].

Legend: B batch.

    judge = JudgeReward("http://127.0.0.1:8000/v1", "Is the answer correct and shown with its steps?",
                        model="judge")                   # any OpenAI-compatible endpoint
    judge = JudgeReward(judge_generator, rubric)          # a local ModelGenerate
    rewards = judge(rollouts, answers)                    # (B,) float32; judge.last: what happened

The reply must end with exactly one line `VERDICT: <integer 0..max_score>` (or `A | B | TIE` with
`pairwise=True`, asked in both orders); anything else, or a failing judge, pays 0 and is counted in `last`.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.reward.base import as_reward_tensor, check_batch, final_model_message

VERDICT = re.compile(r"^VERDICT:[ \t]*(\S.*?)[ \t]*$", re.M)
POINTWISE_ASK = ("Judge the response by the criteria above. End your reply with exactly one line:\n"
                 "VERDICT: <an integer from 0 to {max_score}>")
PAIRWISE_ASK = ("Which response is better by the criteria above? End your reply with exactly one line:\n"
                "VERDICT: A, VERDICT: B or VERDICT: TIE")
PAIR_PAYS = {"A": (1.0, 0.0), "B": (0.0, 1.0), "TIE": (0.5, 0.5)}  # (to response A, to response B)


def parse_verdict(reply: str | None, allowed: Callable[[str], float | None]) -> float | None:
    """The value of the reply's one `VERDICT:` line, which must end it; None when that is not so."""
    if not isinstance(reply, str):
        return None
    found = VERDICT.findall(reply)
    if len(found) != 1 or not reply.rstrip().endswith(found[0]):
        return None
    return allowed(found[0])


def _score_in(max_score: int) -> Callable[[str], float | None]:
    def allowed(text: str) -> float | None:
        return int(text) / max_score if re.fullmatch(r"\d{1,6}", text) and int(text) <= max_score else None

    return allowed


def _pair_choice(text: str) -> str | None:
    return text if text in PAIR_PAYS else None


def _section(tag: str, text: str) -> str:
    inside = text.replace(f"</{tag}>", f"<\\/{tag}>")  # a closing tag planted in the text stays text
    return f"<{tag}>\n{inside}\n</{tag}>"


def question_of(rollout: Rollout) -> str:
    """The task the rollout answers: metadata["question"], else its first user message."""
    question = rollout.metadata.get("question")
    if question is not None:
        return str(question)
    first = next((m for m in rollout if m.type is MessageType.MESSAGE), None)
    return first.content if first is not None else ""


def openai_judge(base_url: str, model: str, *, api_key: str = "EMPTY", max_tokens: int = 512,
                 temperature: float = 0.0, timeout: float = 60.0) -> Callable[[str], str]:
    """One prompt -> the reply of an OpenAI-compatible `/chat/completions` endpoint (raises on failure)."""
    url = base_url.rstrip("/") + "/chat/completions"

    def ask(prompt: str) -> str:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": temperature}
        request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (the caller's URL)
            reply = json.loads(response.read())
        content = reply["choices"][0]["message"]["content"]
        if not isinstance(content, str):
            raise ValueError(f"the judge's reply has no text content: {content!r}")
        return content

    return ask


def _generator_judge(generator) -> Callable[[list[str]], list[str]]:
    """A local generator (`generate(rollouts) -> [[Message]]`, e.g. ModelGenerate): one batch per call."""

    def ask(prompts: list[str]) -> list[str]:
        replies = generator.generate([Rollout([Message(p, MessageType.MESSAGE)]) for p in prompts])
        return [choices[0].content for choices in replies]

    return ask


class JudgeReward:
    """An LLM judge as a reward: `reward(rollouts, ground_truths) -> (B,)` float32 in [0, 1] (module docstring).

    judge: the base URL of an OpenAI-compatible endpoint (with `model`), a local generator with
    `generate(rollouts)` (ModelGenerate), or a function `prompts -> replies` (a list of str each).
    rubric: the criteria, in words. ground_truths (optional, required when `pairwise`): each row's
    reference answer. max_score: the top of the judge's integer scale. batch_size: judge calls in
    flight (HTTP) or prompts per call (a generator or a function). cache_size: verdicts kept.
    `last` holds the counts of the latest call, `totals` those of every call.
    """

    name = "judge"

    def __init__(self, judge, rubric: str, *, model: str | None = None, pairwise: bool = False,
                 max_score: int = 10, batch_size: int = 8, api_key: str = "EMPTY", max_tokens: int = 512,
                 temperature: float = 0.0, timeout: float = 60.0, cache_size: int = 10_000):
        if not isinstance(rubric, str) or not rubric.strip():
            raise ValueError(f"JudgeReward rubric must be non-empty text, got {rubric!r}")
        for name, value, least in (("max_score", max_score, 1), ("batch_size", batch_size, 1),
                                   ("cache_size", cache_size, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"JudgeReward {name} must be an int >= {least}, got {value!r}")
        self.rubric, self.pairwise, self.max_score, self.batch_size = rubric.strip(), pairwise, max_score, batch_size
        self.cache_size = cache_size
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._ask, self._one_at_a_time = self._backend(judge, model, api_key, max_tokens, temperature, timeout)
        self.last: dict[str, int] = {}
        self.last_error: str | None = None  # what the latest failed judge call said
        self.totals: Counter[str] = Counter()

    @staticmethod
    def _backend(judge, model, api_key, max_tokens, temperature, timeout):
        if isinstance(judge, str):
            if not judge.startswith(("http://", "https://")):
                raise ValueError(f"JudgeReward judge as a string must be an http(s) base URL, got {judge!r}")
            if not model:
                raise ValueError("JudgeReward with an endpoint URL needs model= (the name the endpoint serves)")
            return openai_judge(judge, model, api_key=api_key, max_tokens=max_tokens, temperature=temperature,
                                timeout=timeout), True
        if callable(getattr(judge, "generate", None)):
            return _generator_judge(judge), False
        if callable(judge):
            return judge, False
        raise TypeError("JudgeReward judge must be an endpoint URL, a generator with generate(rollouts) or a "
                        f"function prompts -> replies, got {type(judge).__name__}")

    def __repr__(self) -> str:
        return f"JudgeReward(pairwise={self.pairwise}, max_score={self.max_score})"

    def prompt(self, question: str, response: str, reference: Any = None) -> str:
        """The pointwise judge prompt for one response."""
        parts = [self.rubric, _section("question", question)]
        if reference is not None:
            parts.append(_section("reference", str(reference)))
        parts += [_section("response", response), POINTWISE_ASK.format(max_score=self.max_score)]
        return "\n\n".join(parts)

    def pair_prompt(self, question: str, first: str, second: str) -> str:
        """The pairwise judge prompt: `first` is response A, `second` response B."""
        return "\n\n".join([self.rubric, _section("question", question), _section("response_A", first),
                             _section("response_B", second), PAIRWISE_ASK])

    def __call__(self, rollouts: Sequence[Rollout], ground_truths: Sequence[Any] | None = None) -> torch.Tensor:
        gts = check_batch(rollouts, ground_truths)
        if self.pairwise:
            missing = [i for i, gt in enumerate(gts) if gt is None or (isinstance(gt, str) and not gt.strip())]
            if missing:
                raise ValueError(f"a pairwise JudgeReward compares each response with its row's reference "
                                 f"answer (the ground truth); rows {missing[:10]} have none")
        asks = [self._prompts(r, gt) for r, gt in zip(rollouts, gts, strict=True)]  # [] when no MODEL turn
        replies, counts = self._replies([p for prompts in asks for p in prompts])
        values = []
        for prompts in asks:
            value, outcome = self._value([replies.get(p) for p in prompts])
            counts[outcome] += 1
            values.append(value)
        self.last = {k: counts[k] for k in ("judged", "cached", "scored", "unparsed", "errors", "no_response")}
        self.totals.update(self.last)
        return as_reward_tensor(values)  # (B,)

    def _prompts(self, rollout: Rollout, ground_truth: Any) -> list[str]:
        message = final_model_message(rollout)
        if message is None:
            return []
        question, response = question_of(rollout), message.content
        if not self.pairwise:
            return [self.prompt(question, response, ground_truth)]
        reference = str(ground_truth)
        return [self.pair_prompt(question, response, reference), self.pair_prompt(question, reference, response)]

    def _value(self, replies: list[str | None]) -> tuple[float, str]:
        """(reward, outcome) of one rollout from its judge replies (None: the call failed)."""
        if not replies:
            return 0.0, "no_response"
        if any(r is None for r in replies):
            return 0.0, "errors"
        if not self.pairwise:
            score = parse_verdict(replies[0], _score_in(self.max_score))
            return (0.0, "unparsed") if score is None else (score, "scored")
        first, second = (parse_verdict(r, _pair_choice) for r in replies)
        if first is None or second is None:
            return 0.0, "unparsed"
        return (PAIR_PAYS[first][0] + PAIR_PAYS[second][1]) / 2, "scored"  # the response is A, then B

    def _replies(self, prompts: list[str]) -> tuple[dict[str, str | None], Counter]:
        """Each distinct prompt's reply (None when the judge failed): cached ones, the rest asked in batches."""
        counts: Counter[str] = Counter()
        replies: dict[str, str | None] = {}
        for p in prompts:
            if p in self._cache and p not in replies:
                self._cache.move_to_end(p)
                replies[p] = self._cache[p]
                counts["cached"] += 1
        todo = list(dict.fromkeys(p for p in prompts if p not in replies))
        counts["judged"] = len(todo)
        for start in range(0, len(todo), self.batch_size):
            chunk = todo[start: start + self.batch_size]
            for p, reply in zip(chunk, self._ask_chunk(chunk), strict=True):
                replies[p] = reply
                if reply is not None and self.cache_size:
                    self._cache[p] = reply
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
        return replies, counts

    def _ask_chunk(self, prompts: list[str]) -> list[str | None]:
        """The judge's replies to `prompts`; None for each that failed. Never raises."""
        if self._one_at_a_time:
            def one(prompt: str) -> str | None:
                try:
                    return self._ask(prompt)
                except Exception as e:  # noqa: BLE001  (an HTTP error, a timeout, a malformed reply: counted)
                    self.last_error = f"{type(e).__name__}: {e}"
                    return None

            with ThreadPoolExecutor(max_workers=len(prompts), thread_name_prefix="judge") as pool:
                return list(pool.map(one, prompts))
        try:
            replies = list(self._ask(list(prompts)))
        except Exception as e:  # noqa: BLE001
            self.last_error = f"{type(e).__name__}: {e}"
            return [None] * len(prompts)
        if len(replies) != len(prompts):
            self.last_error = f"the judge gave {len(replies)} replies to {len(prompts)} prompts"
            return [None] * len(prompts)
        return [r if isinstance(r, str) else None for r in replies]
