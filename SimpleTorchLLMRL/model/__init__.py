"""Models: `generation/` (how a turn is sampled; `generator.ModelGenerate` is the front), `scoring/`
(per-token log-probs through the output head) and the weights' modules `lora`, `adapters`, `dropout`.

Nothing is imported eagerly, so `import SimpleTorchLLMRL.model` stays cheap; import the modules.
"""
