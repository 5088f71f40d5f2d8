"""Models: `generation.generator.ModelGenerate` over two subpackages, and the weights' modules.

- `generation/`: how a turn is sampled (sampling, picker, constrain, the HF and vLLM backends,
  the fast decode, the vLLM engine and its stream, weight_sync; `generator`: ModelGenerate);
- `scoring/`: per-token log-probs through the output head (logprobs, head, hidden, the kernels,
  shared_prefix, truncation, liger);
- here: `lora`, `adapters`, `dropout`; `ModelGenerate` is `generation/generator.py`.

Nothing is imported eagerly, so `import SimpleTorchLLMRL.model` stays cheap; import the modules.
`MOVED` is the one table of the modules that moved into the subpackages: their old paths
(`SimpleTorchLLMRL.model.logprobs`, `from SimpleTorchLLMRL.model import sampling`, ...) give the
new module itself, with a DeprecationWarning, for one release (`utils/moved.py`, CHANGELOG.md).
"""

from SimpleTorchLLMRL.utils.moved import alias_moved

_G, _S = "SimpleTorchLLMRL.model.generation", "SimpleTorchLLMRL.model.scoring"

MOVED = {  # old path -> new module; "module:name" rows: a name that left its module when logprobs was split
    "SimpleTorchLLMRL.model.constrain": f"{_G}.constrain",
    "SimpleTorchLLMRL.model.fast_decode": f"{_G}.fast_decode",
    "SimpleTorchLLMRL.model.hf_backend": f"{_G}.hf_backend",
    "SimpleTorchLLMRL.model.picker": f"{_G}.picker",
    "SimpleTorchLLMRL.model.sampling": f"{_G}.sampling",
    "SimpleTorchLLMRL.model.vllm": f"{_G}.vllm",
    "SimpleTorchLLMRL.model.vllm_engine": f"{_G}.vllm_engine",
    "SimpleTorchLLMRL.model.vllm_stream": f"{_G}.vllm_stream",
    "SimpleTorchLLMRL.model.watch": f"{_G}.sampling",  # DecodeWatch now lives in sampling
    "SimpleTorchLLMRL.model.weight_sync": f"{_G}.weight_sync",
    "SimpleTorchLLMRL.model.head_kernels": f"{_S}.head_kernels",
    "SimpleTorchLLMRL.model.head_triton": f"{_S}.head_triton",
    "SimpleTorchLLMRL.model.liger": f"{_S}.liger",
    "SimpleTorchLLMRL.model.logprobs": f"{_S}.logprobs",
    "SimpleTorchLLMRL.model.shared_prefix": f"{_S}.shared_prefix",
    "SimpleTorchLLMRL.model.truncation": f"{_S}.truncation",
    "SimpleTorchLLMRL.model.logprobs:check_vocabulary": f"{_S}.head",
    "SimpleTorchLLMRL.model.logprobs:model_vocab_size": f"{_S}.head",
    "SimpleTorchLLMRL.model.logprobs:right_padded_attention": f"{_S}.hidden",
    "SimpleTorchLLMRL.model.logprobs:PrefixPlan": f"{_S}.shared_prefix",
    "SimpleTorchLLMRL.model.logprobs:causal_mask_4d": f"{_S}.shared_prefix",
    "SimpleTorchLLMRL.model.logprobs:check_shared_prefix": f"{_S}.shared_prefix",
    "SimpleTorchLLMRL.model.logprobs:forward_last_logits": f"{_S}.shared_prefix",
    "SimpleTorchLLMRL.model.logprobs:last_hidden": f"{_S}.shared_prefix",
    "SimpleTorchLLMRL.model.logprobs:plan_shared_prefix": f"{_S}.shared_prefix",
    "SimpleTorchLLMRL.model.logprobs:shared_prefix_hidden_states": f"{_S}.shared_prefix",
}

__getattr__ = alias_moved(__name__, MOVED)
