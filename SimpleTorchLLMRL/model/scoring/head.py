"""The output head: what it is (module, vocabulary, soft-cap), and the forward to the hidden states it scores.

Legend: B batch, T tokens, H hidden size, V vocab.

`unwrap` sees through DDP / torch.compile wrappers; `output_head` is the output embedding
(peft-wrapped or not); `check_vocabulary` holds a tokenizer to the ids the model scores;
`head_logits` is what the head computes, soft-capped like the model; `supports_fused` says
whether the custom autograd paths (`head_kernels`) may run on it. `final_hidden_states` runs the
model once to its final hidden states (its own head scoring only the last position) and checks
once per model that the head really gives its logits; `shared_prefix` runs a group's prompt once.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from SimpleTorchLLMRL.utils.warn import warn_user

_VERIFIED: weakref.WeakSet = weakref.WeakSet()  # models whose head was checked once

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


def vocab_size(model) -> int | None:
    """The ids `model` can read and score: the smaller of its input embedding's and output head's rows."""
    sizes = [model_vocab_size(model)]
    get = getattr(model, "get_input_embeddings", None)
    weight = getattr(get(), "weight", None) if get is not None else None
    sizes.append(int(weight.shape[0]) if weight is not None and weight.dim() == 2 else None)
    known = [s for s in sizes if s is not None]
    return min(known) if known else None


def check_token_ids(name: str, batch, model, who: str = "the model") -> None:
    """ValueError naming the rollout when a token id of `batch` (`input_ids`, `attention_mask`) is outside
    `model`'s vocabulary: check before any forward, since on CUDA an embedding lookup past the table is a
    device-side assert that ends the process's CUDA context."""
    size = vocab_size(model)
    if size is None:
        return
    ids = batch.input_ids
    bad = ((ids < 0) | (ids >= size)) & batch.attention_mask.bool()  # (B, T)
    rows = bad.any(-1).nonzero().flatten().tolist()
    if rows:
        t = int(bad[rows[0]].nonzero()[0])
        raise ValueError(f"{name}: rollout {rows[0]} holds token id {int(ids[rows[0], t])} at position {t}, outside "
                         f"{who}'s vocabulary of {size} ids (rollouts {rows[:10]}); were its ids sampled by "
                         "another model or tokenizer?")


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


# ---------------------------------------------------------------- the forward to the final hidden states


class _Scoring:
    depth = 0  # scoring forwards in progress (a plain attribute: `torch.compile` guards on it)


def in_scoring_forward() -> bool:
    """Whether a forward of `model.scoring` (the trainer's, with or without grad) is running: where the
    training-only body kernels run (`model.scoring.liger`); the decode's forwards are not."""
    return _Scoring.depth > 0


@contextlib.contextmanager
def scoring_forward():
    """Marks the forwards inside as the trainer's (`in_scoring_forward`)."""
    _Scoring.depth += 1
    try:
        yield
    finally:
        _Scoring.depth -= 1


def forward_last_logits(model, **kwargs):
    """model(**kwargs) with its head scoring only the last position (`logits_to_keep=1`) where it can."""
    try:
        return model(**kwargs, logits_to_keep=1)
    except TypeError:  # a model without logits_to_keep: pays for its full logits
        return model(**kwargs)


def last_hidden(out) -> torch.Tensor:
    """The final hidden states (after the final norm) of a causal LM's output, (B, T, H)."""
    return out.hidden_states[-1] if getattr(out, "hidden_states", None) is not None else out.last_hidden_state


def final_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        verify: bool = True, *, right_padded: bool = False) -> torch.Tensor:
    """(B, T, H) hidden states that the model's output embedding turns into logits.

    One forward through the whole model (so DDP / FSDP / peft hooks run) with
    `logits_to_keep=1`: the model's own head scores only the last position, which also lets
    us check once per model that `head(hidden_states[-1])` really are its logits (a model
    that post-processes logits otherwise raises instead of silently giving wrong log-probs).
    right_padded: the batch is right-padded (a `Batch` is), so the forward takes a causal
    mask that HF does not read for padding (`right_padded_attention`: no host sync).
    A group's shared prompt run once: `shared_prefix.shared_hidden_states`.
    """
    mask = right_padded_attention(model, attention_mask) if right_padded else attention_mask
    with scoring_forward():
        out = forward_last_logits(model, input_ids=input_ids, attention_mask=mask, output_hidden_states=True,
                                  use_cache=False)
    maybe_verify_head(model, out, verify)
    return last_hidden(out)


def right_padded_attention(model, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """What to pass as `attention_mask` for a RIGHT-padded batch so that the forward never waits for the device.

    Padding sits after every real token, so causality alone keeps it out of every real position
    (padded positions get other hidden states, which nobody scores). HF reads a 2D mask for
    padding, and without one the position ids for packing, with a host sync in each forward; a
    4D mask it uses as given. So this is a (1, 1, T, T) causal mask (`causal_mask_4d`)
    where the model's attention takes one, else the 2D mask as it is.
    """
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    causal = causal_mask_4d(unwrap(model), attention_mask.new_ones(1, attention_mask.shape[1]))
    return attention_mask if causal is None else causal


def in_eval_without_grad(model, fn):
    """fn() without grad, `model` in eval mode (dropout would make two forwards differ), its mode restored."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return fn()
    finally:
        model.train(was_training)


def check_same_states(model, got: torch.Tensor, plain: torch.Tensor, problem: str) -> None:
    """ValueError "<model>: <problem> (max abs difference ...)" when hidden states `got` differ from the plain
    forward's `plain` (both (n, H), float32 or better) beyond the model's dtype's rounding."""
    tol = {torch.float32: 1e-4, torch.float64: 1e-6}.get(plain.dtype, 5e-2)  # HF norms upcast to float32
    got, plain = got.float(), plain.float()
    err = float((got - plain).abs().max()) if plain.numel() else 0.0
    if not err <= tol * (1 + float(plain.abs().max())):
        raise ValueError(f"{type(model).__name__}: {problem.format(err=f'{err:.3g}')}")


def maybe_verify_head(model, out, verify: bool) -> None:
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


def sliding_window_layers(config) -> bool:
    """True when some of the model's layers attend within a sliding window (a full causal mask would be wrong)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return any(t != "full_attention" for t in layer_types)
    return (getattr(config, "sliding_window", None) is not None
            and getattr(config, "use_sliding_window", True) is not False)


def mask_for_attention(model, allowed: torch.Tensor) -> torch.Tensor:
    """A (B, 1, Q, K) bool mask (True attends) as `model`'s attention takes it: bool for "sdpa", additive for "eager"."""
    model = unwrap(model)
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        return allowed
    dtype = next(model.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed,
                                                                                       torch.finfo(dtype).min)


def causal_mask_4d(model, key_valid: torch.Tensor) -> torch.Tensor | None:
    """A (B, 1, T, T) causal mask over the keys `key_valid` (B, T) marks, as HF's attention takes it, or None.

    HF reads a 2D mask for padding with a host sync in every forward; a 4D mask it uses as
    given. Only for its "sdpa" (bool: True attends) and "eager" (additive float) attention on
    full-attention models: None for the others (flash / flex attention read the 2D mask;
    sliding-window layers need their own). Every query also attends to itself, so a padded
    query row is never empty (no NaN in what nobody reads).
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager") or sliding_window_layers(config):
        return None
    T = key_valid.shape[-1]
    eye = torch.eye(T, dtype=torch.bool, device=key_valid.device)
    allowed = (torch.ones_like(eye).tril_() & key_valid.bool()[:, None, None, :]) | eye  # (B, 1, T, T)
    return mask_for_attention(model, allowed)
