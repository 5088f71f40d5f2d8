"""Tiny tokenizers and models built locally, never downloaded.

Used by the tests, benchmarks and examples: a byte-level BPE trained on a
small built-in corpus, wrapped as a `PreTrainedTokenizerFast` with one of three
chat-template styles, and random-init Qwen2 / Llama / GPT-2 models from config.

    tok = tiny_tokenizer("chatml")          # ChatML (Qwen-style, with tools)
    tok = tiny_tokenizer("llama3")          # Llama-3 headers and <|eot_id|>
    tok = tiny_tokenizer("plain")           # GPT-2 style: no template, pad = eos
    model = tiny_model("qwen2", tok)        # hidden 64, 2 layers
"""

from __future__ import annotations

import functools
from pathlib import Path

# The embedded pretrained default model (built by examples/pretrain_tiny.py).
TINY_CALC = Path(__file__).resolve().parent.parent / "assets" / "tiny_calc"

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
ALL_SPECIALS = CHATML_SPECIALS + LLAMA3_SPECIALS

# A Qwen2.5-style ChatML template: tools in the system turn, assistant tool calls
# as <tool_call> JSON, tool results as a user turn wrapped in <tool_response>.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{%- if not loop.first %}"
    "{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama-3 style: BOS once, header tokens, trimmed content, <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n'"
    " + message.content | trim + '<|eot_id|>' %}"
    "{%- if loop.index0 == 0 %}{%- set content = bos_token + content %}{%- endif %}"
    "{{- content }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

_STYLES = {  # tiny_tokenizer's special tokens and template per style
    "chatml": dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML_TEMPLATE),
    "llama3": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|endoftext|>",
                   chat_template=LLAMA3_TEMPLATE),
    "plain": dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"),
}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 35? The answer is \\boxed{47}.",
    "Let me think step by step. 7 * 8 = 56, so the result is 56.",
    "You are a helpful assistant. Answer the question.",
    "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"3 * (4 + 5)\"}}\n</tool_call>",
    "<tool_response>\n27\n</tool_response> <search> <answer> </answer> <think> </think>",
    "def f(x):\n    return x ** 2 + 1\nprint(f(3))",
    "Question: how many apples? Answer: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "assistant user system tool function arguments expression result",
]


@functools.cache
def _bpe_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=ALL_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer(style: str = "chatml", vocab_size: int = 512, padding_side: str = "right"):
    """A deterministic byte-level BPE tokenizer with a chat template of `style`.

    style: "chatml" (eos/eot `<|im_end|>`, pad `<|endoftext|>`), "llama3"
    (bos `<|begin_of_text|>`, eos/eot `<|eot_id|>`), or "plain" (GPT-2 style:
    no chat template, eos `<|endoftext|>` doubles as pad).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if style not in _STYLES:
        raise ValueError(f"tiny_tokenizer style must be 'chatml', 'llama3' or 'plain', got {style!r}")
    backend = Tokenizer.from_str(_bpe_json(vocab_size))
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side=padding_side, **_STYLES[style])


def tiny_model(arch: str = "qwen2", tokenizer=None, *, vocab_size: int | None = None, hidden_size: int = 64,
               num_layers: int = 2, num_heads: int = 4, seed: int = 0, max_position_embeddings: int = 512):
    """A random-init causal LM from config (no download). arch: qwen2 | llama | gpt2."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    if vocab_size is None:
        vocab_size = len(tokenizer) if tokenizer is not None else 512
    ids = {}
    if tokenizer is not None:
        ids = dict(
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
        )
    if arch in ("qwen2", "llama"):
        cls = Qwen2Config if arch == "qwen2" else LlamaConfig
        config = cls(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
            num_hidden_layers=num_layers, num_attention_heads=num_heads,
            num_key_value_heads=max(1, num_heads // 2), max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=True, **ids,
        )
    elif arch == "gpt2":
        config = GPT2Config(
            vocab_size=vocab_size, n_embd=hidden_size, n_layer=num_layers, n_head=num_heads,
            n_positions=max_position_embeddings, **ids,
        )
    else:
        raise ValueError(f"tiny_model arch must be 'qwen2', 'llama' or 'gpt2', got {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if tokenizer is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def load_model_or_tiny(name: str | None = None, seed: int = 0):
    """(model, tokenizer, description) for examples.

    name: a local directory or hub id (loaded with `from_pretrained`), "random"
    (a random tiny Qwen2 with the ChatML tokenizer, context 2048 for tool
    prompts), or None: the embedded tiny_calc model when built, else random.
    """
    import torch

    if name is None:
        name = str(TINY_CALC) if (TINY_CALC / "model.safetensors").exists() else "random"
    if name == "random":
        tok = tiny_tokenizer("chatml")
        return tiny_model("qwen2", tok, seed=seed, max_position_embeddings=2048), tok, "random tiny qwen2"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32), tok, name
