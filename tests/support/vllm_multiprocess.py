"""Run by tests/model/test_vllm_real.py in its own process: the real engine in multi-process mode (its worker in
another process, as on GPUs), pushed through `ModelGenerate.push_weights` and checked after each push.

Prints one JSON line: the probe gaps, the sampled log-probs against HF's, and what a push missing a weight
raised. The `__main__` guard is what vLLM's spawned worker needs.
"""

import copy
import json
import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # our push sends a callable with its tensors


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from SimpleTorchLLMRL.chat.message import Message, Rollout
    from SimpleTorchLLMRL.chat.tokenize import encode_prompt
    from SimpleTorchLLMRL.model.generation import weight_sync
    from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
    from SimpleTorchLLMRL.model.generation.vllm_engine import WeightSyncError, in_process, make_llm
    from SimpleTorchLLMRL.model.lora import apply_lora
    from SimpleTorchLLMRL.testing.tiny import TINY_CALC
    from tests.support.engine_helpers import hf_logprobs, missing_a_weight, perturbed

    model = AutoModelForCausalLM.from_pretrained(TINY_CALC, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(TINY_CALC)
    llm = make_llm(TINY_CALC, max_model_len=512, enforce_eager=True)
    out = {"in_process": in_process(llm)}
    torch.manual_seed(0)
    other = perturbed(model)
    gen = ModelGenerate(llm, tok, max_new_tokens=12, temperature=1.0, seed=2)
    gen.push_weights(other, mode="full")
    out["full_gap"] = gen.backend.last_agreement
    rollout = Rollout([Message("What is 12 + 35?")])
    msg = gen.generate([rollout])[0][0]
    want = hf_logprobs(other, encode_prompt(rollout, tok), list(msg.token_ids))
    out["sampled_vs_hf"] = float((torch.tensor(msg.logprobs) - want).abs().max())
    policy = apply_lora(copy.deepcopy(model), r=4, alpha=16, init_lora_weights=False)
    gen.push_weights(policy, mode="merged")
    out["merged_gap"] = gen.backend.last_agreement
    weight_sync.vllm_weights = missing_a_weight(weight_sync.vllm_weights)
    try:
        gen.push_weights(model, mode="full")
        out["missed_weight"] = "not caught"
    except WeightSyncError as e:
        out["missed_weight"] = str(e)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
