"""Test helpers for the losses area: rollouts built by hand and naive float64 references."""

from __future__ import annotations

import copy

import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import rollouts_to_batch

QUESTIONS = ["What is 12 + 35?", "What is 7 * 8?"]
ANSWERS = ["The answer is \\boxed{47}.", "Let me think step by step.", "7 * 8 = 56, so 56",
           "I do not know the answer"]


def make_rollouts(num_questions: int = 2, group: int = 3, system: bool = True) -> list[Rollout]:
    """num_questions x group rollouts: system + user + one MODEL reply each, grouped by prompt."""
    out = []
    for q in QUESTIONS[:num_questions]:
        for k in range(group):
            msgs = [Message("You are a helpful assistant.", MessageType.SYSTEM)] if system else []
            msgs += [Message(q), Message(ANSWERS[k % len(ANSWERS)], MessageType.MODEL)]
            out.append(Rollout(msgs))
    return out


def multi_turn_rollout() -> Rollout:
    """user, MODEL (trained), TOOL (not trained), MODEL (trained), user (not trained, trailing)."""
    return Rollout([
        Message("What is 3 * (4 + 5)?"),
        Message("<tool_call> calculator </tool_call>", MessageType.MODEL),
        Message("27", MessageType.TOOL),
        Message("The answer is 27.", MessageType.MODEL),
        Message("Thanks!"),
    ])


def naive_logprobs(model, batch, temperature: float = 1.0, entropy: bool = False):
    """Full-vocab float64 log-softmax over the model's logits; (B, T) aligned with input_ids."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double()
    logp_all = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)  # (B, T-1, V)
    lp = logp_all.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    lp = torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1)
    if not entropy:
        return lp
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return lp, torch.cat([ent.new_zeros(ent.shape[0], 1), ent], dim=1)


def trained_positions(batch):
    """loss_mask without column 0 (no prediction there): what the trainers actually train, (B, T)."""
    m = batch.loss_mask.clone()
    m[:, 0] = 0
    return m


def batch_of(rollouts, tokenizer):
    return rollouts_to_batch(rollouts, tokenizer)


def with_sampled_logprobs(rollouts, model, tokenizer, temperature: float, shift: float = 0.0):
    """Copies whose MODEL messages carry token_ids and logprobs (computed by the model at
    `temperature`, minus `shift`), as a generator would record them."""
    out = []
    for r in rollouts:
        new = Rollout(metadata=dict(r.metadata))
        for m in r:
            if m.type is MessageType.MODEL:
                ids = tokenizer(m.content, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                m = Message(m.content, MessageType.MODEL, token_ids=ids, logprobs=[0.0] * len(ids),
                            temperature=temperature)
            new.add_messages(m)
        out.append(new)
    batch = rollouts_to_batch(out, tokenizer)
    with torch.no_grad():
        lp = naive_logprobs(model, batch, temperature).float()
    for i, r in enumerate(out):
        sampled = ~torch.isnan(batch.sampler_logprobs[i])
        vals = (lp[i][sampled] - shift).clamp(max=0).tolist()
        for m in r:
            if m.type is MessageType.MODEL:
                n = len(m.token_ids)
                m.logprobs, vals = vals[:n], vals[n:]
    return out


def grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def assert_grads_close(g1, g2, rtol=1e-4, atol=1e-6):
    for n in g1:
        torch.testing.assert_close(g1[n].double(), g2[n].double(), rtol=rtol, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


def perturbed_copy(model, scale: float = 0.05):
    """A reference model near `model`: a deep copy with N(0, scale^2) added to every weight."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(scale * torch.randn_like(p))
    return ref
