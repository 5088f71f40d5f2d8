"""Per-token log-probs and entropy of the next token, computed in chunks.

Legend: B batch, T tokens, H hidden size, V vocab, N selected positions, n chunk.

Per-token tensors are (B, T) and ALIGNED WITH input_ids:
`logp[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`; column 0 is 0 (nothing
predicts the first token), so they line up with `loss_mask` and `sampler_logprobs`.

A full (B, T, V) float32 log-softmax is never built. The model runs once to
its final hidden states (`hidden.final_hidden_states`: `output_hidden_states=True,
logits_to_keep=1`, so the model's own head only scores the last position), then the
output embedding (`head`) scores chunks of `chunk_size` positions at a time:

- plain `nn.Linear` head: two passes around one autograd node (`head_autograd._TwoPassHead`).
  Pass 1 keeps only per-token float32 statistics (log p(y), entropy, logsumexp); the
  caller's loss runs once on the (N,) log-probs and entropy with autograd; pass 2
  (backward) recomputes one chunk of logits at a time into dL/dz from dL/dlogp and
  dL/dentropy and the gradient GEMMs. No autograd graph per chunk. When the head's
  weight is frozen (LoRA) the per-token Jacobian d logp / d h (N, H) is built
  in pass 1, so a backward without an entropy gradient costs no extra matmul.
- `fused_token_loss`: when the loss is a sum of per-token terms whose only
  variable is logp (GRPO at token level), the gradient is known as soon as a
  chunk is scored, so it is chained into the hidden-state / weight gradients
  right away: three matmuls in all, like the naive path, one chunk in memory.
- any other head (peft-wrapped, quantized, soft-capped logits): each chunk runs
  under `torch.utils.checkpoint`, so backward keeps one chunk's logits at a time.

Three kernels (`head_kernels`) score a chunk, chosen by one switch, `head_impl`:

- "cpu": row blocks inside a chunk whose float32 scratch stays under glibc's mmap
  threshold (fast on CPUs, where fresh large blocks are page-faulted on every use);
- "gpu": whole-chunk ops, the head's matmuls in its own dtype (bf16 tensor cores)
  with float32 accumulation and float32 softmax statistics, chunks sized by bytes
  (`GPU_CHUNK_BYTES` of logits) rather than by a token count: a handful of
  large kernels per chunk and no per-row Python loop on the device.

- "triton": the "gpu" kernel's GEMMs with its elementwise passes replaced by two Triton
  kernels (`head_triton`): one read of the logits for the softmax statistics, one that
  writes their gradient in the head's dtype.

"auto" (the default) takes "triton" for CUDA tensors ("gpu" when Triton is missing) and
"cpu" otherwise. "gpu" runs on the CPU too, and "triton" does in Triton's interpreter
(TRITON_INTERPRET=1), so the numerics of both are tested without a GPU.

The entropy has a gradient (an entropy term in a loss trains through it).

truncation (a `chat.truncation.Truncation`, per token): tokens that the sampler drew with top-k /
top-p / min-p are scored under that same truncated, renormalized distribution, log p_trunc(y) =
z_y / T - logsumexp over the kept set, on every kernel and path, with gradient (`truncation`;
entropy is then the truncated distribution's too). None (the default): the full softmax.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from SimpleTorchLLMRL.model.scoring import head_triton
from SimpleTorchLLMRL.model.scoring.head import head_logits, logit_softcap, output_head, supports_fused
from SimpleTorchLLMRL.model.scoring.head_autograd import _FusedTokenLoss, _TwoPassHead
from SimpleTorchLLMRL.model.scoring.head_kernels import _chunks, _DeviceChunks, _LinearChunks, _TritonChunks
from SimpleTorchLLMRL.model.scoring.hidden import final_hidden_states
from SimpleTorchLLMRL.model.scoring.shared_prefix import first_positions
from SimpleTorchLLMRL.model.scoring.truncation import apply_cut, keep_threshold

DEFAULT_CHUNK_SIZE = None  # None: 512 tokens on the "cpu" kernel, GPU_CHUNK_BYTES of logits on "gpu" / "triton"
CPU_CHUNK_SIZE = 512
# float32 logits per chunk of the "gpu" and "triton" kernels. Measured on an H100 (Qwen2.5-0.5B, 33k tokens,
# "triton"): 128 / 256 / 512 / 1024 MiB took 0.74 / 0.62 / 0.49 / 0.48 s per loss + backward, the same peak
# up to 512 MiB (docs/benchmarks.md#gpu): each chunk pays a fixed cost (its loss terms, kernel launches,
# one read-modify-write of the float32 weight gradient).
GPU_CHUNK_BYTES = 512 * 2**20
HEAD_IMPLS = ("auto", "cpu", "gpu", "triton")


class TokenLogProbs(NamedTuple):
    """What `token_logprobs` returns when asked for more than the log-probs. All (B, T) but hidden."""

    logprobs: torch.Tensor  # (B, T) float32
    entropy: torch.Tensor | None  # (B, T) float32, detached
    hidden_states: torch.Tensor | None  # (B, T, H) final hidden states (after the final norm)


def resolve_head_impl(impl: str, device: torch.device) -> str:
    """The chunk kernel that `head_impl` names for tensors on `device`: "cpu", "gpu" or "triton"."""
    if impl not in HEAD_IMPLS:
        raise ValueError(f"head_impl={impl!r} is invalid; expected one of {HEAD_IMPLS}")
    if impl == "auto":
        return ("triton" if head_triton.available() else "gpu") if device.type == "cuda" else "cpu"
    return impl


def _kernel(impl: str, device: torch.device):
    """The chunk kernel class of `head_impl` for tensors on `device`."""
    impl = resolve_head_impl(impl, device)
    if impl == "triton":
        head_triton.check_device(device)
    return {"cpu": _LinearChunks, "gpu": _DeviceChunks, "triton": _TritonChunks}[impl]


def _chunk_tokens(kernel, chunk_size: int | None, vocab: int) -> int:
    """Tokens per chunk: the caller's, else 512 on the cpu kernel, GPU_CHUNK_BYTES of float32 logits on gpu."""
    if chunk_size is not None:
        return chunk_size
    if issubclass(kernel, _DeviceChunks):
        return max(64, GPU_CHUNK_BYTES // (4 * vocab) // 64 * 64)
    return CPU_CHUNK_SIZE


def _generic_chunk(head, softcap, inv_temp):
    def run(hc, yc, trunc=None):
        z = head_logits(head, hc, softcap) * inv_temp  # (n, V)
        if trunc is not None:  # the kept set's threshold is piecewise constant in z: no gradient through it
            z = apply_cut(z, keep_threshold(z, trunc, yc))
        lse = torch.logsumexp(z, dim=-1)
        logp = z.gather(1, yc[:, None]).squeeze(1) - lse
        logsm = z - lse[:, None]
        ent = -torch.bmm(logsm.exp().unsqueeze(1), logsm.unsqueeze(2)).view(-1)
        return logp, ent

    return run


def _check(temperature: float, chunk_size: int | None, head_impl: str = "auto") -> float:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (or None: by kernel), got {chunk_size}")
    if head_impl not in HEAD_IMPLS:
        raise ValueError(f"head_impl={head_impl!r} is invalid; expected one of {HEAD_IMPLS}")
    return 1.0 / float(temperature)


def logprobs_from_hidden(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, *,
                         temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE,
                         softcap: float | None = None, upcast: bool = False, fused: bool | None = None,
                         head_impl: str = "auto", truncation=None):
    """Chunked log-prob and entropy of `targets` given the hidden states that predict them.

    hidden (N, H), targets (N,) -> (logp (N,) float32, entropy (N,) float32 detached).
    `upcast` runs the head's matmul in float32 (plain Linear heads only; logits
    and the log-softmax are always float32). `fused=None` picks the custom
    autograd path for a plain `nn.Linear` head, checkpointed chunks otherwise.
    head_impl: the chunk kernel of the custom path, "auto" | "cpu" | "gpu" | "triton" (module docstring).
    chunk_size None: by kernel (512 tokens on cpu, GPU_CHUNK_BYTES of logits on gpu).
    truncation: (N,) `Truncation` of the targets, None: the full softmax (module docstring).
    """
    inv_temp = _check(temperature, chunk_size, head_impl)
    grad = torch.is_grad_enabled()
    if fused is None:
        fused = supports_fused(head, softcap)
    if fused:
        frozen = not head.weight.requires_grad and not (head.bias is not None and head.bias.requires_grad)
        jacobian = grad and hidden.requires_grad and frozen
        kernel = _kernel(head_impl, hidden.device)
        return _TwoPassHead.apply(hidden, head.weight, head.bias, targets, inv_temp,
                                  _chunk_tokens(kernel, chunk_size, head.weight.shape[0]), upcast, jacobian, kernel,
                                  truncation)
    run = _generic_chunk(head, softcap, inv_temp)
    if chunk_size is None:
        chunk_size = CPU_CHUNK_SIZE
    rows = lambda sl: None if truncation is None else truncation.map(lambda t: t[sl])  # noqa: E731
    outs = [checkpoint(run, hidden[sl], targets[sl], rows(sl), use_reentrant=False) if grad
            else run(hidden[sl], targets[sl], rows(sl)) for sl in _chunks(hidden.shape[0], chunk_size)]
    if not outs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def fused_token_loss(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, token_loss, *,
                     temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE, upcast: bool = False,
                     head_impl: str = "auto", truncation=None):
    """sum_i token_loss(logp, sl)_i with the backward work done chunk by chunk during the forward.

    hidden (N, H), targets (N,). `token_loss(logp (n,), sl)` returns the (n,)
    per-token loss of the tokens `sl` (a slice into 0..N); it may depend on
    logp only through elementwise ops, everything else it reads must be a
    constant (advantages, old / reference log-probs, weights). Returns
    (loss scalar with grad, logp (N,) detached, entropy (N,) detached).
    Needs a plain `nn.Linear` head (see `supports_fused`). head_impl, truncation: as `logprobs_from_hidden`.
    """
    inv_temp = _check(temperature, chunk_size, head_impl)
    if not supports_fused(head):
        raise ValueError(f"fused_token_loss needs a plain nn.Linear output head, got {type(head).__name__}")
    grad = torch.is_grad_enabled()
    bias = head.bias
    need = (grad and hidden.requires_grad, grad and head.weight.requires_grad,
            grad and bias is not None and bias.requires_grad)
    kernel = _kernel(head_impl, hidden.device)
    return _FusedTokenLoss.apply(hidden, head.weight, bias, targets, token_loss, inv_temp,
                                 _chunk_tokens(kernel, chunk_size, head.weight.shape[0]), upcast, need, kernel,
                                 truncation)


def scatter_positions(values: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """Put N per-position values back into a (B, T) tensor aligned with input_ids.

    values (N,), select (B, T-1) bool (position t+1 predicted from t) -> (B, T), zeros elsewhere.
    """
    B = select.shape[0]
    body = torch.zeros(select.shape, dtype=values.dtype, device=values.device).masked_scatter(select, values)
    return torch.cat([body.new_zeros(B, 1), body], dim=1)


def logprobs_at(hidden: torch.Tensor, model, input_ids: torch.Tensor, positions: torch.Tensor, *,
                temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE, upcast: bool = False,
                fused: bool | None = None, head_impl: str = "auto",
                index: torch.Tensor | None = None, truncation=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) log-probs and entropy of input_ids from hidden (B, T, H), only where `positions` (B, T) is set.

    Column 0 and unset positions are 0. index: the (N,) long flat positions b * T + t that predict
    the set positions (`trainer.batch.trained_index(positions)`), found before the forward: the
    tokens are then gathered and scattered back without a host sync. truncation: the (B, T)
    `Truncation` of input_ids (None: the full softmax).
    """
    head_opts = dict(temperature=temperature, chunk_size=chunk_size, softcap=logit_softcap(model), upcast=upcast,
                     fused=fused, head_impl=head_impl)
    if index is not None:
        B, T = input_ids.shape
        h = hidden.reshape(B * T, -1).index_select(0, index)  # (N, H)
        y = input_ids.reshape(-1).index_select(0, index + 1)  # (N,)
        trunc = None if truncation is None else truncation.at(index + 1)
        lp, ent = logprobs_from_hidden(h, output_head(model), y, truncation=trunc, **head_opts)
        return scatter_index(lp, index + 1, (B, T)), scatter_index(ent, index + 1, (B, T))
    select = positions[:, 1:].bool()  # (B, T-1): token t+1 ...
    h = hidden[:, :-1][select]  # (N, H) ... is predicted from position t
    y = input_ids[:, 1:][select]  # (N,)
    trunc = None if truncation is None else truncation.map(lambda t: t[:, 1:][select])
    lp, ent = logprobs_from_hidden(h, output_head(model), y, truncation=trunc, **head_opts)
    return scatter_positions(lp, select), scatter_positions(ent, select)


def scatter_index(values: torch.Tensor, index: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """values (N,) put at the flat positions `index` (N,) of a (B, T) tensor of zeros (no host sync)."""
    flat = torch.zeros(shape[0] * shape[1], dtype=values.dtype, device=values.device)
    return flat.index_put((index,), values).view(shape)


def token_logprobs(model, batch, temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE,
                   return_entropy: bool = False, *, positions: torch.Tensor | None = None,
                   return_hidden: bool = False, upcast: bool = False, fused: bool | None = None,
                   share_prefix: bool = False, head_impl: str = "auto", truncation=None):
    """Per-token log-probs of `batch.input_ids` under `model` at `temperature`, (B, T).

    batch: a `Batch` (or anything with `input_ids` and `attention_mask`).
    positions: (B, T) 0/1, which tokens to score (default: attention_mask;
    pass `loss_mask` to skip prompts entirely). Unscored positions and column 0 are 0.
    Returns the (B, T) tensor, or a `TokenLogProbs(logprobs, entropy, hidden_states)`
    when `return_entropy` or `return_hidden` is set (the hidden states come from
    the same forward, e.g. for a value head). share_prefix: rows with the same tokens
    before their first scored position run those tokens once (`final_hidden_states`'s
    `start`); hidden states before that position are then 0. head_impl: the chunk
    kernel, "auto" | "cpu" | "gpu" | "triton" (module docstring). truncation: the (B, T) `Truncation` of
    the tokens sampled with top-k / top-p / min-p (`Batch.truncation`), None: the full softmax.
    """
    _check(temperature, chunk_size, head_impl)
    input_ids, attention_mask = batch.input_ids, batch.attention_mask
    if positions is None:
        positions = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    if positions.shape != input_ids.shape:
        raise ValueError(f"positions has shape {tuple(positions.shape)}, input_ids {tuple(input_ids.shape)}")
    start = first_positions(positions) if share_prefix else None
    hidden = final_hidden_states(model, input_ids, attention_mask, start=start)  # (B, T, H)
    logp, ent = logprobs_at(hidden, model, input_ids, positions, temperature=temperature,
                            chunk_size=chunk_size, upcast=upcast, fused=fused, head_impl=head_impl,
                            truncation=truncation)
    if not (return_entropy or return_hidden):
        return logp
    return TokenLogProbs(logp, ent if return_entropy else None, hidden if return_hidden else None)
