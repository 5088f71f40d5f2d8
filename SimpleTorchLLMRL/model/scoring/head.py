"""What a causal LM's output head is: the module, its vocabulary, its soft-cap, and whether the fast paths apply.

Legend: H hidden size, V vocab.

`unwrap` sees through DDP / torch.compile wrappers; `output_head` is the output embedding
(peft-wrapped or not); `check_vocabulary` holds a tokenizer to the ids the model scores;
`head_logits` is what the head computes, soft-capped like the model; `supports_fused` says
whether the custom autograd paths (`head_autograd`) may run on it.
"""

from __future__ import annotations

import torch
from torch import nn

from SimpleTorchLLMRL.utils.warn import warn_user


def unwrap(model):
    """DDP / torch.compile wrappers -> the module that has `config` and the output embedding."""
    while hasattr(model, "module") and not hasattr(model, "get_output_embeddings"):
        model = model.module
    return getattr(model, "_orig_mod", model)


def output_head(model) -> nn.Module:
    """The output embedding (lm_head) of a causal LM, peft-wrapped or not."""
    head = unwrap(model).get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embedding (get_output_embeddings() is None)")
    return head


def model_vocab_size(model) -> int | None:
    """Rows of the output head (the ids the model can score), None when the model has no readable head."""
    try:
        head = output_head(model)
    except (AttributeError, ValueError):
        return None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None and weight.dim() == 2 else None


def check_vocabulary(model, tokenizer) -> None:
    """A tokenizer with more ids than the model scores is an error; a much smaller one is a warning.

    Models often pad their embedding past the tokenizer (Qwen2.5: 151,936 rows for 151,665
    tokens), so a small surplus is normal; a surplus of more than max(2048, 5%) usually means
    the tokenizer belongs to another model, whose ids mean other words to this one.
    """
    n_model, n_tok = model_vocab_size(model), len(tokenizer) if hasattr(tokenizer, "__len__") else None
    if n_model is None or n_tok is None:
        return
    if n_tok > n_model:
        raise ValueError(f"the tokenizer has {n_tok} tokens but the model scores only {n_model}: ids >= {n_model} "
                         "would index past its embedding. Use the model's own tokenizer, or after adding "
                         "tokens call model.resize_token_embeddings(len(tokenizer)).")
    if n_model - n_tok > max(2048, n_tok // 20):
        warn_user(f"the model scores {n_model} token ids but the tokenizer has only {n_tok}: is it the model's own "
                  "tokenizer? A tokenizer of another model maps its ids to other words (this is a warning only "
                  "because some models pad their embedding generously).")


def logit_softcap(model) -> float | None:
    """`final_logit_softcapping` of Gemma-2-style configs, else None."""
    config = getattr(unwrap(model), "config", None)
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def head_logits(head: nn.Module, h: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """(..., H) -> (..., V) float32 logits, soft-capped like the model does."""
    z = head(h).float()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z


def supports_fused(head: nn.Module, softcap: float | None = None) -> bool:
    """True for a plain `nn.Linear` head without logit soft-capping (the custom autograd paths)."""
    return type(head) is nn.Linear and type(head.weight.data) is torch.Tensor and not softcap

