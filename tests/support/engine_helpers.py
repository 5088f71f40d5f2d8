"""Helpers shared by the real-engine tests (tests/test_vllm_*.py and tests/support/vllm_multiprocess.py)."""

import copy
import gc
import threading

import torch

from SimpleTorchLLMRL.model.scoring.logprobs import token_logprobs
from SimpleTorchLLMRL.testing.tiny import TINY_CALC


def tiny_calc_hf():
    """(model, tokenizer): the embedded calculator model in float32, eval mode, as the engines load it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(TINY_CALC, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(TINY_CALC)


def tiny_calc_engine(**engine_kwargs):
    """A module fixture's body: a vLLM engine on the embedded calculator model (T=1, 1024 positions, eager),
    freed after the module (`gc.collect`: objects of the tests may hold it in cycles)."""
    from SimpleTorchLLMRL.model.generation.vllm_engine import make_llm

    engine = make_llm(TINY_CALC, temperature=1.0, max_model_len=1024, enforce_eager=True, **engine_kwargs)
    yield engine
    del engine
    gc.collect()


def hf_logprobs(model, prompt: list[int], sampled: list[int]) -> torch.Tensor:
    """The HF model's log-probs of `sampled` after `prompt`, (len(sampled),)."""
    ids = torch.tensor([prompt + sampled])

    class Batch:
        input_ids, attention_mask = ids, torch.ones_like(ids)

    with torch.no_grad():
        return token_logprobs(model, Batch)[0, len(prompt):]


def perturbed(model, scale: float = 0.02):
    """A copy of `model` with Gaussian noise of `scale` added to every weight (torch's global RNG)."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * scale)
    return other


def missing_a_weight(vllm_weights):
    """`vllm_weights` without layer 0's MLP down projection: a push that never delivers one weight (as a
    renamed parameter would)."""
    def without_one(model, *args, **kwargs):
        weights = vllm_weights(model, *args, **kwargs)
        return {n: t for n, t in weights.items() if not ("layers.0" in n and n.endswith("down_proj.weight"))}

    return without_one


class EngineSteps:
    """Counts a `vllm.LLM`'s engine steps (`llm_engine.step`, real engine or tests/support/fake_vllm.py); `hold_at`: the step
    of that number waits (up to 60 s) for `release`, so a test can see what went out while the engine runs."""

    def __init__(self, llm, hold_at: int | None = None):
        self.engine, self.count, self.hold_at = llm.llm_engine, 0, hold_at
        self.release, self.released_in_time = threading.Event(), None
        self._step = self.engine.step
        self.engine.step = self._counted

    def _counted(self):
        self.count += 1
        if self.hold_at is not None and self.count == self.hold_at:
            self.released_in_time = self.release.wait(60)
        return self._step()

    def remove(self) -> None:
        self.release.set()
        del self.engine.step  # the class's step again
