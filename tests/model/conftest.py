"""Fixtures the model package's tests share: a peaked tiny Qwen2, the fake vLLM, the real vLLM engine."""

import pytest

from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer
from tests.support.fake_vllm import install_fake_vllm
from tests.support.generation_helpers import peaked


@pytest.fixture(scope="module")
def qwen():
    """(model, tokenizer): a tiny Qwen2 with peaked logits, so sampling settings visibly change the draw."""
    tok = tiny_tokenizer("chatml")
    return peaked(tiny_model("qwen2", tok), std=0.08), tok


@pytest.fixture
def vllm(monkeypatch):
    """The fake `vllm` module (tests/support/fake_vllm.py), installed for one test."""
    return install_fake_vllm(monkeypatch)


@pytest.fixture(scope="module")
def hf():
    """The embedded calculator model in HF, to compare the engine against."""
    from tests.support.engine_helpers import tiny_calc_hf

    return tiny_calc_hf()


@pytest.fixture(scope="module")
def llm(request):
    """The real vLLM CPU engine over the embedded calculator model, one per module: LoRA enabled unless the
    module sets `ENGINE = dict(...)`, the engine's options."""
    from tests.support.engine_helpers import tiny_calc_engine

    yield from tiny_calc_engine(**getattr(request.module, "ENGINE", dict(enable_lora=True, max_lora_rank=8)))
