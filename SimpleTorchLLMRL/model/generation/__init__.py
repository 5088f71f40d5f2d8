"""Generation: how a model turn is sampled, its ids and log-probs kept as sampled.

`sampling` (shared types, the `Backend` protocol), `picker`, `constrain`, the backends `hf_backend` and
`vllm`, `fast_decode`, the vLLM engine (`vllm_engine`, `vllm_stream`), `weight_sync`; `generator.ModelGenerate`
is the front. Nothing is imported here; scoring never imports generation.
"""
