"""Fixtures every package's tests share: tiny tokenizers and models built locally, the embedded calculator model
(nothing is downloaded). Each folder's conftest.py adds what its package's tests share."""

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer  # noqa: E402
from tests.support.gateway_helpers import load_calc  # noqa: E402
from tests.support.stages import pytest_collection_modifyitems, pytest_runtest_protocol  # noqa: E402, F401 (the two stages' hooks)

# Tiny models gain nothing from intra-op threads; one thread avoids oversubscribing small CI machines.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def chatml_tokenizer():
    """Byte-level BPE with <|im_start|>/<|im_end|> and a Qwen2.5-style ChatML template."""
    return tiny_tokenizer("chatml")


@pytest.fixture(scope="session")
def llama3_tokenizer():
    """Byte-level BPE with Llama-3 headers, BOS and <|eot_id|>."""
    return tiny_tokenizer("llama3")


@pytest.fixture(scope="session")
def plain_tokenizer():
    """GPT-2 style: no chat template, pad = eos = <|endoftext|>."""
    return tiny_tokenizer("plain")


@pytest.fixture(params=["chatml", "llama3", "plain"])
def any_tokenizer(request):
    return tiny_tokenizer(request.param)


@pytest.fixture
def qwen2_model(chatml_tokenizer):
    return tiny_model("qwen2", chatml_tokenizer)


@pytest.fixture
def llama_model(llama3_tokenizer):
    return tiny_model("llama", llama3_tokenizer)


@pytest.fixture
def gpt2_model(plain_tokenizer):
    return tiny_model("gpt2", plain_tokenizer)


@pytest.fixture(scope="session")
def tok(chatml_tokenizer):
    """`chatml_tokenizer` under the short name the model and recipe tests use."""
    return chatml_tokenizer


@pytest.fixture(scope="module")
def calc():
    """(model, tokenizer) of the embedded calculator model, left-padded, in eval mode; one per module."""
    return load_calc()


@pytest.fixture
def restore_qwen2(monkeypatch):
    """Liger patches transformers' qwen2 module for the whole process: put it back after the test."""
    from transformers.models.qwen2 import modeling_qwen2

    for name in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP"):
        monkeypatch.setattr(modeling_qwen2, name, getattr(modeling_qwen2, name))
