"""Scoring: per-token log-probs and entropy through the output head, never a (B, T, V) float32 tensor.

`logprobs` (the entry points: `token_logprobs`, `logprobs_from_hidden`, `fused_token_loss`),
`head` (what the output head is), `hidden` (the forward to the final hidden states), the chunk
kernels (`head_kernels`, `head_triton`) and the autograd paths over them (`head_autograd`),
`shared_prefix` (a group's prompt run once), `truncation` (top-k / top-p / min-p's kept set, shared
with the sampler) and `liger` (fused body kernels).

Nothing is imported here; import the modules. Scoring imports no other part of `model`.
"""
