"""What the gateway tests share: the embedded calculator model, its env, a first conversation."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from SimpleTorchLLMRL.env import ToolUseEnv
from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT
from SimpleTorchLLMRL.testing.tiny import TINY_CALC
from SimpleTorchLLMRL.tools import calculator

QUESTION = "What is 645 * 49?"


def load_calc():
    """(model, tokenizer) of the embedded tiny calculator model, left-padded, in eval mode."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY_CALC).eval()
    tok = AutoTokenizer.from_pretrained(TINY_CALC, padding_side="left")
    return model, tok


def calc_env() -> ToolUseEnv:
    return ToolUseEnv([calculator], custom_sys_prompt=SYSTEM_PROMPT, max_turns=3)


def start(question: str = QUESTION) -> list[dict]:
    """The first messages of an episode, as an OpenAI client sends them."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def parse_chat(body: dict, defaults=None, **ctx):
    """`chat.parse` of a body against a stand-in for the gateway (`ctx` overrides its fields)."""
    from types import SimpleNamespace

    from SimpleTorchLLMRL.gateway import chat
    from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig

    fields = dict(model_name="policy", defaults=defaults or SamplingConfig(), vocab_size=None, tool_parsers=None,
                  supports_top_logprobs=True, tokenizer=None) | ctx
    return chat.parse(body, SimpleNamespace(**fields))
