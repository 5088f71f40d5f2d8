"""The forward that token log-probs start from: the model's final hidden states, its head checked once.

Legend: B batch, T tokens, H hidden size, V vocab.

One forward through the whole model (so DDP / FSDP / peft hooks run) with `logits_to_keep=1`,
optionally with a group's shared prompt run once (`shared_prefix`); the output head then scores
chunks of these hidden states (`logprobs`).
"""

from __future__ import annotations

import weakref

import torch

from SimpleTorchLLMRL.model.scoring.head import head_logits, logit_softcap, output_head, unwrap
from SimpleTorchLLMRL.model.scoring.shared_prefix import (
    PrefixPlan,
    causal_mask_4d,
    check_shared_prefix,
    forward_last_logits,
    last_hidden,
    plan_shared_prefix,
    shared_prefix_hidden_states,
)

_VERIFIED: weakref.WeakSet = weakref.WeakSet()  # models whose head was checked once


def final_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        verify: bool = True, start: torch.Tensor | None = None, *,
                        prefix_plan: PrefixPlan | None = None, right_padded: bool = False) -> torch.Tensor:
    """(B, T, H) hidden states that the model's output embedding turns into logits.

    One forward through the whole model (so DDP / FSDP / peft hooks run) with
    `logits_to_keep=1`: the model's own head scores only the last position,
    which also lets us check once per model that `head(hidden_states[-1])`
    really are its logits (a model that post-processes logits otherwise
    raises instead of silently giving wrong log-probs).

    start (B,) long, with a right-padded attention_mask: only positions >= start are
    needed, so rows with identical tokens before `start` run that prefix once
    (`shared_prefix`); positions before `start` are then 0. Checked once per model
    against the plain forward. prefix_plan: `plan_shared_prefix(input_ids, attention_mask,
    start)` found before the forward (else found here, which waits for the device).
    right_padded: the batch is right-padded (a `Batch` is), so the plain forward takes a causal
    mask that HF does not read for padding (`right_padded_attention`: no host sync).
    """
    if prefix_plan is None and start is not None and attention_mask is not None:
        prefix_plan = plan_shared_prefix(input_ids, attention_mask, start)
    if prefix_plan is not None and prefix_plan.group is not None:
        if verify:
            check_shared_prefix(model, input_ids, attention_mask, prefix_plan.start)
        shared = shared_prefix_hidden_states(model, input_ids, attention_mask, prefix_plan.start, plan=prefix_plan)
        if shared is not None:
            hidden, out = shared
            _maybe_verify_head(model, out, verify)  # against the suffix forward's own last position
            return hidden
    mask = right_padded_attention(model, attention_mask) if right_padded else attention_mask
    out = forward_last_logits(model, input_ids=input_ids, attention_mask=mask, output_hidden_states=True,
                              use_cache=False)
    _maybe_verify_head(model, out, verify)
    return last_hidden(out)


def right_padded_attention(model, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """What to pass as `attention_mask` for a RIGHT-padded batch so that the forward never waits for the device.

    Padding sits after every real token, so causality alone keeps it out of every real position
    (padded positions get other hidden states, which nobody scores). HF reads a 2D mask for
    padding, and without one the position ids for packing, with a host sync in each forward; a
    4D mask it uses as given. So this is a (1, 1, T, T) causal mask (`shared_prefix.causal_mask_4d`)
    where the model's attention takes one, else the 2D mask as it is.
    """
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    causal = causal_mask_4d(unwrap(model), attention_mask.new_ones(1, attention_mask.shape[1]))
    return attention_mask if causal is None else causal


def _maybe_verify_head(model, out, verify: bool) -> None:
    logits = getattr(out, "logits", None)
    if verify and logits is not None and unwrap(model) not in _VERIFIED:
        _verify_head(model, last_hidden(out), logits)


def _verify_head(model, hidden: torch.Tensor, logits: torch.Tensor) -> None:
    with torch.no_grad():
        mine = head_logits(output_head(model), hidden[:, -1:], logit_softcap(model))  # (B, 1, V)
        theirs = logits[:, -1:].float()
        tol = 1e-4 if theirs.dtype == torch.float32 and hidden.dtype == torch.float32 else 5e-2
        if mine.shape != theirs.shape or not torch.allclose(mine, theirs, atol=tol * (1 + theirs.abs().max()), rtol=0):
            raise ValueError(
                f"{type(model).__name__}: output_embeddings(hidden_states[-1]) does not reproduce the model's "
                "logits (it post-processes them in a way token_logprobs does not know); chunked log-probs "
                "would be wrong for this model"
            )
    _VERIFIED.add(unwrap(model))

