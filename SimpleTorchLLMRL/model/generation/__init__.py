"""Generation: how a model turn is sampled, its ids and log-probs kept as sampled.

`sampling` (the shared types and the `Backend` protocol), `picker` (one decode step's token and
log-prob), `constrain` (structured output), the backends `hf_backend` and `vllm`, the fast HF decode
(`fast_decode`), the vLLM engine (`vllm_engine`, `vllm_stream`) and
`weight_sync` (pushing trained weights into an engine). `generator.ModelGenerate` is the front.

Nothing is imported here; import the modules. Uses `model.scoring` and the weights modules
(`model.lora`, `model.adapters`); scoring never imports generation.
"""
