"""Scoring: per-token log-probs and entropy through the output head, never a (B, T, V) float32 tensor.

`logprobs` (the entry points: `score`, `token_logprobs`, `logprobs_from_hidden`, `fused_token_loss`,
and `ComputeOptions`), `head` (what the output head is, and the forward to its hidden states), the
chunk kernels and the autograd paths over them (`head_kernels`, `head_triton`), `shared_prefix` (a
group's prompt run once), `truncation` (top-k / top-p / min-p's kept set, shared with the sampler)
and `liger` (fused body kernels).

Nothing is imported here; import the modules. Scoring imports no other part of `model`.
"""
