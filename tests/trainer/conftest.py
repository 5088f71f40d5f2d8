"""Fixtures the trainer's tests share."""

import pytest
from transformers import AutoTokenizer

from SimpleTorchLLMRL.testing.tiny import TINY_CALC


@pytest.fixture(scope="module")
def calc_tok():
    """The embedded calculator model's tokenizer, as saved (right padding)."""
    return AutoTokenizer.from_pretrained(TINY_CALC)
