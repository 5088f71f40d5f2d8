"""Models: generation (`generate.ModelGenerate`), the vLLM backend (`vllm`), log-probs and LoRA helpers.

Nothing is imported here so that `import SimpleTorchLLMRL.model` stays cheap; import the submodules.
"""
