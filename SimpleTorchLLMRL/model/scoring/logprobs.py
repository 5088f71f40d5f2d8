"""Per-token log-probs and entropy of the next token, from the model's final hidden states, in chunks.

Legend: B batch, T tokens, H hidden size, V vocab, N scored tokens, n chunk.

`score(model, batch, compute)` is the trainer's one entry: the model runs once to its final hidden
states (`head.final_hidden_states`, or `shared_prefix.shared_hidden_states` with `share_prefix`),
then the output head scores the N tokens the batch names (`token_index`) in chunks; a full
(B, T, V) float32 log-softmax is never built. `token_logprobs` gives the same as a (B, T)
tensor aligned with input_ids (`logp[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`, column
0 is 0), for a batch and a 0/1 mask of positions.

How a chunk is scored (`head_kernels`): a plain `nn.Linear` head runs in two passes around one
autograd node (`_TwoPassHead`: per-token float32 log p, entropy and logsumexp without autograd,
the caller's loss once on them, each chunk's logits recomputed in backward); a loss that is a sum
of per-token terms of logp (`token_loss`) can have its gradient formed chunk by chunk in the
forward instead (`_FusedTokenLoss`, `fused_token_loss`); any other head (peft-wrapped,
quantized, soft-capped) runs each chunk under `torch.utils.checkpoint`. Three chunk kernels, one
switch `head_impl`: "cpu" (row blocks sized for a CPU's allocator), "gpu" (whole-chunk ops, the
head's GEMMs in its dtype with float32 accumulation and softmax statistics, chunks sized by
bytes) and "triton" (the "gpu" GEMMs, two Triton kernels for the elementwise passes); "auto" picks
"triton" on CUDA ("gpu" without Triton), else "cpu". All three run on a CPU ("triton" in Triton's
interpreter), so CI tests each against float64. The entropy has a gradient.

truncation (a `chat.truncation.Truncation`, per token): tokens drawn with top-k / top-p / min-p
are scored under that same truncated, renormalized distribution on every kernel and path.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from SimpleTorchLLMRL.model.scoring import head_triton
from SimpleTorchLLMRL.model.scoring.head import (
    final_hidden_states,
    head_logits,
    logit_softcap,
    output_head,
    supports_fused,
)
from SimpleTorchLLMRL.model.scoring.head_kernels import (
    _chunks,
    _DeviceChunks,
    _FusedTokenLoss,
    _LinearChunks,
    _TritonChunks,
    _TwoPassHead,
)
from SimpleTorchLLMRL.model.scoring.packing import (
    bucket,
    check_packing,
    packed_hidden_states,
    packing_kind,
    why_not_packed,
)
from SimpleTorchLLMRL.model.scoring.shared_prefix import (
    first_positions,
    plan_shared_prefix,
    shared_hidden_states,
)
from SimpleTorchLLMRL.model.scoring.truncation import apply_cut, keep_threshold
from SimpleTorchLLMRL.utils.warn import warn_user

DEFAULT_CHUNK_SIZE = None  # None: 512 tokens on the "cpu" kernel, GPU_CHUNK_BYTES of logits on "gpu" / "triton"
CPU_CHUNK_SIZE = 512
# float32 logits per chunk of the "gpu" and "triton" kernels. Measured on an H100 (Qwen2.5-0.5B, 33k tokens,
# "triton"): 128 / 256 / 512 / 1024 MiB took 0.74 / 0.62 / 0.49 / 0.48 s per loss + backward, the same peak
# up to 512 MiB (docs/benchmarks.md#gpu): each chunk pays a fixed cost (its loss terms, kernel launches,
# one read-modify-write of the float32 weight gradient).
GPU_CHUNK_BYTES = 512 * 2**20
HEAD_IMPLS = ("auto", "cpu", "gpu", "triton")
_UNPACKABLE: weakref.WeakSet = weakref.WeakSet()  # models whose packed forward failed its check (packed=None pads)


@dataclass
class ComputeOptions:
    """How the numbers are computed, not what they are; keyword arguments of every trainer front."""

    chunk_size: int | None = DEFAULT_CHUNK_SIZE
    """Trained tokens scored per chunk of the output head; None: by kernel (512 tokens on "cpu",
    GPU_CHUNK_BYTES of float32 logits on "gpu" / "triton")."""
    head_impl: str = "auto"
    """The chunk kernel: "auto" ("triton" on CUDA, "gpu" there without Triton, else "cpu"), "cpu",
    "gpu" or "triton"."""
    fused: bool | None = None
    """A loss made of per-token terms (GRPO's, PPO's) forms its gradient chunk by chunk in the forward
    when the head allows (True), or runs the two-pass head (False); None: fused on the "cpu" kernel,
    two-pass on "gpu" / "triton". Same values either way."""
    share_prefix: bool = False
    """The rows that share their tokens before the first trained one (a group's prompt) run them once
    (`model.scoring.shared_prefix`; checked against the plain forward once per model)."""
    max_length: int | None = None
    """Rollouts longer than this many tokens are an error, or are cut with `truncate` (`encode_rollout`)."""
    truncate: bool = False
    """Cut rollouts longer than `max_length` instead of refusing them."""
    packed: bool | None = None
    """Padding-free batches: the rows packed side by side with their own position ids, attention kept
    inside each row (`model.scoring.packing`). True packs (a model whose attention cannot is an error),
    False pads, None packs where the model's attention takes packed rows ("sdpa", "eager", flash
    attention; not with share_prefix or sliding-window layers) and pads elsewhere."""
    length_buckets: int | None = None
    """Round the forward's lengths (a packed row's slots and the packed rows' count, a padded batch's
    columns) up to one of k sizes per doubling, so a compiled body sees few shapes; None: exact lengths."""

    def __post_init__(self):
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size={self.chunk_size!r} is invalid; expected None or an int >= 1")
        if self.head_impl not in HEAD_IMPLS:
            raise ValueError(f"head_impl={self.head_impl!r} is invalid; expected one of {HEAD_IMPLS}")
        if self.packed not in (None, True, False):
            raise ValueError(f"packed={self.packed!r} is invalid; expected True, False or None (where the model can)")
        if self.packed and self.share_prefix:
            raise ValueError("packed=True and share_prefix=True do not combine (a packed row runs each prompt in "
                             "its own row); pick one: share_prefix=True runs padded")
        if self.length_buckets is not None and (isinstance(self.length_buckets, bool) or self.length_buckets < 1):
            raise ValueError(f"length_buckets={self.length_buckets!r} is invalid; expected None or an int >= 1")


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


class Scores(NamedTuple):
    """What `score` returns."""

    logprobs: torch.Tensor  # (N,) float32 log p of the scored tokens: with grad, detached when `loss` is set
    entropy: torch.Tensor  # (N,) float32
    hidden: torch.Tensor  # (N, H) the final hidden states that predict the scored tokens (a value head reads them)
    loss: torch.Tensor | None  # the sum of `token_loss` formed chunk by chunk in the forward; None: not fused


def hidden_states(model, batch, compute: ComputeOptions) -> torch.Tensor:
    """(N, H) final hidden states that predict the batch's scored tokens (`token_index` order), whatever the layout.

    The one place that knows how rows are laid out: packed (`batch.pack_plan`, found before the forward,
    where this model's attention takes it: `model.scoring.packing`), each group's prompt run once
    (`share_prefix`, `batch.prefix_plan`) or right-padded (columns rounded up by `length_buckets`)."""
    plan = getattr(batch, "pack_plan", None)
    if plan is not None and packs(model, compute, batch):
        return packed_hidden_states(model, batch.input_ids, plan)
    B, T = batch.input_ids.shape
    if compute.share_prefix:
        hidden = shared_hidden_states(model, batch.input_ids, batch.attention_mask, plan=batch.prefix_plan,
                                      right_padded=True)
    else:
        columns = bucket(T, compute.length_buckets) - T
        ids, mask = (F.pad(t, (0, columns)) for t in (batch.input_ids, batch.attention_mask))
        hidden = final_hidden_states(model, ids, mask, right_padded=True)[:, :T]
    return hidden.reshape(B * T, -1).index_select(0, batch.token_index)


def packs(model, compute: ComputeOptions, batch=None) -> bool:
    """Whether `model` runs packed rows under `compute.packed` (True: it must; None: where its attention can).

    With a batch, its plan is checked against the padded forward once per model (`check_packing`): under
    None a model that differs, or whose packed forward raises, warns and pads from then on; under True the
    error is raised."""
    if compute.packed is False or compute.share_prefix:
        return False
    if packing_kind(model) is None:
        if compute.packed:
            raise ValueError(f"packed=True: {why_not_packed(model)}; use packed=None (pads where it cannot) or False")
        return False
    if batch is None or model in _UNPACKABLE:
        return model not in _UNPACKABLE
    try:
        check_packing(model, batch.input_ids, batch.attention_mask, batch.token_index, batch.pack_plan)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:  # a kernel that fails here too
        if compute.packed:
            raise
        warn_user(f"{type(model).__name__}: its packed forward failed its check against the padded one "
                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Running it padded (packed=None).")
        _UNPACKABLE.add(model)
        return False
    return True


def score(model, batch, compute: ComputeOptions, *, temperature: float = 1.0, hidden: torch.Tensor | None = None,
          token_loss=None) -> Scores:
    """Log-probs and entropy of the N tokens that `batch` scores, from the model's final hidden states.

    batch: `input_ids` (B, T), `attention_mask`, `token_index` (N,) long flat positions b * T + t whose
    hidden state predicts a scored token (the token is at index + 1; found before the forward, so
    nothing here waits for the device), `prefix_plan` (share_prefix) and `truncation` ((B, T) or None).
    hidden: `hidden_states(model, batch, compute)`'s (N, H) when the caller ran it. token_loss(logp (n,), sl) -> (n,) or a
    scalar: a loss whose terms depend on each token's logp alone; with `compute.fused` (None: the
    "cpu" kernel) and a plain Linear head its gradient is formed chunk by chunk (`Scores.loss`).
    """
    h = hidden_states(model, batch, compute) if hidden is None else hidden  # (N, H): position t predicts t + 1
    index = batch.token_index
    y = batch.input_ids.reshape(-1).index_select(0, index + 1)  # (N,)
    trunc = None if batch.truncation is None else batch.truncation.at(index + 1)
    head, softcap = output_head(model), logit_softcap(model)
    opts = dict(temperature=temperature, chunk_size=compute.chunk_size, head_impl=compute.head_impl, truncation=trunc)
    fused = compute.fused if compute.fused is not None else resolve_head_impl(compute.head_impl, h.device) == "cpu"
    if token_loss is not None and fused and supports_fused(head, softcap):
        loss, logp, entropy = fused_token_loss(h, head, y, token_loss, **opts)
        return Scores(logp, entropy, hidden, loss)
    logp, entropy = logprobs_from_hidden(h, head, y, softcap=softcap, **opts)
    return Scores(logp, entropy, hidden, None)


def scatter_index(values: torch.Tensor, index: torch.Tensor, shape: tuple[int, int], fill: float = 0.0):
    """values (N,) put at the flat positions `index` (N,) of a (B, T) tensor filled with `fill` (no host sync)."""
    flat = torch.full((shape[0] * shape[1],), fill, dtype=values.dtype, device=values.device)
    return flat.index_put((index,), values).view(shape)


class _Positions(NamedTuple):  # what `score` reads, for `token_logprobs`' batch and mask
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    token_index: torch.Tensor
    prefix_plan: object
    truncation: object


class TokenLogProbs(NamedTuple):
    """What `token_logprobs` returns when asked for more than the log-probs. All (B, T) but hidden."""

    logprobs: torch.Tensor  # (B, T) float32
    entropy: torch.Tensor | None  # (B, T) float32
    hidden_states: torch.Tensor | None  # (B, T, H) final hidden states (after the final norm)


def token_logprobs(model, batch, temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE,
                   return_entropy: bool = False, *, positions: torch.Tensor | None = None,
                   return_hidden: bool = False, upcast: bool = False, fused: bool | None = None,
                   share_prefix: bool = False, head_impl: str = "auto", truncation=None):
    """Per-token log-probs of `batch.input_ids` under `model` at `temperature`, (B, T), 0 where not scored.

    batch: a `Batch` (or anything with `input_ids` and `attention_mask`). positions: (B, T) 0/1, the
    tokens to score (default: attention_mask; pass `loss_mask` to skip prompts); column 0 is never
    scored. Returns the (B, T) tensor, or `TokenLogProbs(logprobs, entropy, hidden_states)` with
    `return_entropy` / `return_hidden`. share_prefix: rows with the same tokens before their first
    scored position run them once (hidden states before it are then 0). upcast / fused: as
    `logprobs_from_hidden`; head_impl: the chunk kernel; truncation: the (B, T) `Truncation` of
    tokens drawn with top-k / top-p / min-p (`Batch.truncation`), None: the full softmax.
    Finding the scored positions waits for the device once (the trainer finds them before the forward).
    """
    _check(temperature, chunk_size, head_impl)
    input_ids, attention_mask = batch.input_ids, batch.attention_mask
    if positions is None:
        positions = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    if positions.shape != input_ids.shape:
        raise ValueError(f"positions has shape {tuple(positions.shape)}, input_ids {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    select = torch.zeros(positions.shape, dtype=torch.bool, device=positions.device)  # (B, T)
    select[:, :-1] = positions[:, 1:].bool()  # position t predicts token t + 1
    index = select.reshape(-1).nonzero().squeeze(1)  # (N,)
    plan = None
    if share_prefix and attention_mask is not None:
        plan = plan_shared_prefix(input_ids, attention_mask, first_positions(positions))
        hidden = shared_hidden_states(model, input_ids, attention_mask, plan=plan)
    else:
        hidden = final_hidden_states(model, input_ids, attention_mask)
    h = hidden.reshape(B * T, -1).index_select(0, index)
    y = input_ids.reshape(-1).index_select(0, index + 1)
    trunc = None if truncation is None else truncation.at(index + 1)
    lp, ent = logprobs_from_hidden(h, output_head(model), y, temperature=temperature, chunk_size=chunk_size,
                                   softcap=logit_softcap(model), upcast=upcast, fused=fused, head_impl=head_impl,
                                   truncation=trunc)
    logp = scatter_index(lp, index + 1, (B, T))
    if not (return_entropy or return_hidden):
        return logp
    return TokenLogProbs(logp, scatter_index(ent, index + 1, (B, T)) if return_entropy else None,
                         hidden if return_hidden else None)
