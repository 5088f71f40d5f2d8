"""A MODEL turn's token_ids decode to its content, or encoding says so (issue 43, item 5, ids vs text).

Before (8c45457) a turn whose ids came from another tokenizer, or from another text, trained silently:
the reward read the content and the gradient the ids. Now `encode_rollouts` / `rollouts_to_batch` raise a
ValueError naming the turn, unless `check_ids=False`. What the library's own generator leaves (stop
strings that end inside a token, tool-call stops, EOS, a cut at max_new_tokens, sampled text),
`as_sampled`, and a part of the decoded text that a parser kept (a final answer) always pass.
"""

import pytest

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout, check_ids_decode
from SimpleTorchLLMRL.chat.tokenize import as_sampled, encode_rollout, rollouts_to_batch
from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig


def sampled(tok, content, ids=None):
    ids = tok(content, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] if ids is None else ids
    return Message(content, MessageType.MODEL, token_ids=ids, logprobs=[-0.5] * len(ids), temperature=1.0)


def test_ids_of_another_text_are_refused_naming_the_turn(chatml_tokenizer):
    tok = chatml_tokenizer
    wrong = tok(r"The answer is \boxed{4}", add_special_tokens=False)["input_ids"]
    r = Rollout([Message("2 + 2?"), sampled(tok, r"The answer is \boxed{5}", wrong)])
    with pytest.raises(ValueError, match=r"message 1: its token_ids decode to .*boxed\{4\}.* content is .*boxed\{5\}"):
        encode_rollout(r, tok)
    ok = Rollout([Message("2 + 2?"), sampled(tok, r"The answer is \boxed{5}")])
    with pytest.raises(ValueError, match=r"rollout 1, message 1"):
        rollouts_to_batch([ok, r], tok)
    assert encode_rollout(r, tok, check_ids=False).input_ids[-len(wrong):] == wrong  # the opt-out


def test_ids_of_another_tokenizer_are_refused(chatml_tokenizer):
    tok = chatml_tokenizer
    text = "Let me compute 12 * 7 with the calculator."
    shifted = [(7 * t + 3) % len(tok) for t in tok(text, add_special_tokens=False)["input_ids"]]  # another numbering
    with pytest.raises(ValueError, match="another tokenizer"):
        encode_rollout(Rollout([Message("q"), sampled(tok, text, shifted)]), tok)
    outside = Rollout([Message("q"), sampled(tok, text, [3, len(tok) + 5])])  # the vocabulary check's to name
    check_ids_decode([outside], tok)


def test_a_content_is_the_ids_text_or_a_part_of_it(chatml_tokenizer):
    tok = chatml_tokenizer
    text = "first part. second part. third part."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    cut = tok.decode(ids[:-1]) + tok.decode(ids[-1:])[:1]  # a stop string that ends inside the last token
    spaced = text.replace(".", " .")  # a decoder's clean-up of spaces before punctuation
    for part in (cut, spaced, "third part.", "second part", ""):  # a parser may keep the final answer only
        check_ids_decode([Rollout([sampled(tok, part, ids)])], tok)
    for other in ("first part. fourth part.", text + " And more.", "third part!"):
        with pytest.raises(ValueError, match="another tokenizer"):  # text the model never wrote
            check_ids_decode([Rollout([sampled(tok, other, ids)])], tok)


def test_as_sampled_turns_pass(chatml_tokenizer, llama3_tokenizer, plain_tokenizer):
    for tok in (chatml_tokenizer, llama3_tokenizer, plain_tokenizer):
        r = Rollout([Message("Hi"), Message("Hello there, café ☕ 😀!", MessageType.MODEL), Message("more"),
                     Message("  padded  ", MessageType.MODEL)])
        check_ids_decode([as_sampled(r, tok)], tok)


@pytest.mark.parametrize("options", [
    dict(),  # EOS or max_new_tokens
    dict(max_new_tokens=3),  # cut short, maybe inside a character
    dict(stop=[" ", "0", "1", "2", "+", "=", "\n"]),  # stop strings that end inside a token
    dict(tool_call_stop=["</tool_call>", "("]),
    dict(temperature=1.5, top_k=50),
])
def test_what_the_generator_leaves_always_passes(calc, options):
    model, tok = calc
    sampling = SamplingConfig(**{"max_new_tokens": 24, "temperature": 1.0, **options})
    gen = ModelGenerate(model, tok, sampling=sampling, seed=0)
    prompts = [Rollout([Message(f"What is {a} + {b}?")]) for a in range(4) for b in (7, 95)]
    rollouts = [r.copy() for r in prompts]
    for r, msgs in zip(rollouts, gen.generate(prompts, n=1), strict=True):
        r.add_messages(msgs[0])
    for r in rollouts:  # a second turn after a tool result: the episode as sampled
        r.add_messages(Message("42", MessageType.TOOL))
    for r, msgs in zip(rollouts, gen.generate(rollouts, n=1), strict=True):
        r.add_messages(msgs[0])
    check_ids_decode(rollouts, tok)
    assert rollouts_to_batch(rollouts, tok).input_ids.shape[0] == len(rollouts)
