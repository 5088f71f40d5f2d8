"""Models: `generation.generator.ModelGenerate` over two subpackages, and the weights' modules.

- `generation/`: how a turn is sampled (sampling, picker, constrain, the HF and vLLM backends,
  the fast decode, the vLLM engine and its stream, weight_sync; `generator`: ModelGenerate);
- `scoring/`: per-token log-probs through the output head (logprobs, head, the kernels,
  shared_prefix, truncation, liger);
- here: `lora`, `adapters`, `dropout`; `ModelGenerate` is `generation/generator.py`.

Nothing is imported eagerly, so `import SimpleTorchLLMRL.model` stays cheap; import the modules.
"""
