"""A few real GRPO steps on the embedded tiny model, for the environment integrations' tests.

    model, tok, gen = tiny_policy()
    norms = grpo_steps(model, tok, lambda: (rollouts, rewards), steps=2)   # each step's gradient norm, > 0
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from SimpleTorchLLMRL import GRPO, ModelGenerate
from SimpleTorchLLMRL.testing.tiny import TINY_CALC


def tiny_policy(max_new_tokens: int = 16, seed: int = 0, **kwargs):
    """(model, tokenizer, generator) of the embedded calculator model, sampling at temperature 1."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(TINY_CALC)
    tok = AutoTokenizer.from_pretrained(TINY_CALC, padding_side="left")
    gen = ModelGenerate(model, tok, max_new_tokens=max_new_tokens, temperature=1.0, seed=seed, **kwargs)
    return model, tok, gen


def grpo_steps(model, tokenizer, collect, steps: int = 2, lr: float = 1e-4, **grpo_options) -> list[float]:
    """`steps` optimizer steps of `GRPO(model, tokenizer).calculate_loss(*collect())`; each step's gradient
    norm, asserted finite and above zero (a reward with no spread in every group would train nothing)."""
    grpo = GRPO(model, tokenizer, temperature=1.0, **grpo_options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    norms = []
    for step in range(steps):
        model.eval()
        rollouts, rewards = collect()
        model.train()
        loss = grpo.calculate_loss(rollouts, rewards)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        assert torch.isfinite(loss) and 0 < norm < float("inf"), (step, loss, norm, rewards)
        optimizer.step()
        optimizer.zero_grad()
        norms.append(norm)
    return norms
