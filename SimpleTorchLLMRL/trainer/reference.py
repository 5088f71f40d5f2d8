"""GRPO on one screen: what `GRPO(model, tokenizer).calculate_loss(rollouts, rewards)` computes, in plain torch.

The readable definition of the default loss (loss_type "grpo", eps 0.2, beta 0, groups of identical
prompts, the rollouts' sampling temperature, turns drawn without top-k / top-p / min-p).
`tests/trainer/test_grpo.py` holds it equal to the real path in value and gradient. It builds the full
(B, T, V) log-softmax: for reading and testing, not for training.
"""

from __future__ import annotations

import torch

from SimpleTorchLLMRL.chat.tokenize import rollouts_to_batch


def grpo_reference(model, tokenizer, rollouts, rewards, eps: float = 0.2) -> torch.Tensor:
    """The default GRPO loss, a scalar with grad. Every prompt needs two rollouts or more."""
    batch = rollouts_to_batch(rollouts, tokenizer)  # ids as sampled, the trained-token mask, sampler log-probs
    ids, temperature = batch.input_ids, batch.sampling_temperature or 1.0  # (B, T)

    # advantages: (r - mean) / (std + 1e-4) within each group of rollouts that share their prompt
    r = torch.as_tensor(rewards, dtype=torch.float32)
    keys = [tuple((m.role, m.name, m.content) for m in x.prompt_messages) for x in rollouts]
    adv = torch.zeros_like(r)
    for key in set(keys):
        members = torch.tensor([k == key for k in keys])
        assert members.sum() > 1, "every prompt needs two rollouts or more"
        adv[members] = (r[members] - r[members].mean()) / (r[members].std() + 1e-4)

    # log pi(token t+1 | tokens <= t) at the sampling temperature, for every position
    logits = model(input_ids=ids, attention_mask=batch.attention_mask).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    mask = batch.loss_mask[:, 1:].float()  # (B, T-1): the trained tokens

    # the old policy is the sampler's log-probs where recorded, else the current one (ratio 1)
    sampled = batch.sampler_logprobs
    old = logp.detach() if sampled is None else torch.where(torch.isnan(sampled[:, 1:]), logp.detach(), sampled[:, 1:])
    ratio = torch.exp(logp - old)

    # PPO's clipped surrogate per token, the mean over each rollout's tokens, the mean over rollouts
    a = adv[:, None]
    per_token = -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
    return ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
