"""Two encoder residuals on real templates and vocabularies (tests/support/real_templates.py).

(a) Qwen2.5's real BPE merges the assistant header's "\\n" with a reply's leading "\\n\\n" into one "\\n\\n\\n"
    token; a hand-written trained turn must then be refused (the mask cannot be exact), never trained
    with the header's text in it.
(b) Phi-3.5's template renders only system, user and assistant turns: a TOOL message must be refused on every
    path (canonical, prompt, as sampled, last message, empty result, result text also written elsewhere),
    never encoded into ids that silently lack the tool result.
"""

from __future__ import annotations

import copy

import pytest

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import as_sampled, encode_prompt, encode_rollout
from tests.support.real_templates import load

U, M, T = MessageType.MESSAGE, MessageType.MODEL, MessageType.TOOL
LEADING = r"merges the chat template's text '\\n' with the message's leading whitespace"
DROPS = r"message 2 \(tool\): the chat template drops TOOL messages"


def _trained_text(tok, enc, index: int | None = None) -> str:
    return tok.decode([t for t, m, i in zip(enc.input_ids, enc.loss_mask, enc.message_index, strict=True)
                       if m and (index is None or i == index)])


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------- (a) leading whitespace, Qwen2.5


@pytest.mark.parametrize("content", ["\n\nIt is 56.", "\nIt is 56.", "\n\n\nIt is 56."])
def test_qwen_reply_with_leading_newlines_is_refused_not_trained_with_the_header(content):
    tok = load("qwen2.5")
    r = Rollout([Message("What is 7*8?", U), Message(content, M)])
    with pytest.raises(ValueError, match=r"message 1: the tokenizer " + LEADING) as err:
        encode_rollout(r, tok)
    assert "strip the leading whitespace" in str(err.value) and "as_sampled" in str(err.value)


def test_qwen_trainable_user_turn_with_leading_newlines_is_refused():
    tok = load("qwen2.5")
    r = Rollout([Message("What is 7*8?", U), Message("56", M), Message("\n\nAre you sure?", U, trainable=True),
                 Message("Yes.", M)])
    with pytest.raises(ValueError, match=r"message 2: the tokenizer " + LEADING):
        encode_rollout(r, tok)


def test_trailing_whitespace_merged_with_template_text_is_refused():
    tok = copy.deepcopy(load("qwen2.5"))  # the loaded tokenizer is shared: do not change its template
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'user' %}{{ 'User:\n' + m.content + '\n' }}"
                         "{% else %}{{ 'Assistant: ' + m.content + '<|im_end|>\n' }}{% endif %}"
                         "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
    with pytest.raises(ValueError, match=r"message 0: .* with the message's trailing whitespace '\\n\\n'"):
        encode_rollout(Rollout([Message("Hi\n\n", U, trainable=True), Message("Yo", M)]), tok)
    enc = encode_rollout(Rollout([Message("Hi", U, trainable=True), Message("Yo", M)]), tok)
    assert _trained_text(tok, enc, 0) == "Hi"


@pytest.mark.parametrize("content", ["It is 56.", " It is 56.", "  It is 56.", "It is\n\n56.\n\n"])
def test_qwen_reply_without_leading_newlines_stays_exact(content):
    tok = load("qwen2.5")
    r = Rollout([Message("What is 7*8?", U), Message(content, M)])
    enc = encode_rollout(r, tok)
    assert enc.input_ids == tok.apply_chat_template(r.to_chat(), tokenize=True, return_dict=False)
    assert _trained_text(tok, enc) == content + "<|im_end|>"


def test_qwen_leading_newlines_are_exact_as_sampled():
    """The fix the error names: as sampled, the prompt ends with the header and the reply's ids follow it."""
    tok = load("qwen2.5")
    r = Rollout([Message("What is 7*8?", U), Message("\n\nIt is 56.", M)])
    enc = encode_rollout(as_sampled(r, tok), tok)
    reply = _ids(tok, "\n\nIt is 56.") + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert enc.input_ids == encode_prompt(Rollout(r.messages[:1]), tok) + reply
    assert [t for t, m in zip(enc.input_ids, enc.loss_mask, strict=True) if m] == reply


# ---------------------------------------------------------------------- (b) Phi-3.5 drops TOOL messages


def _calc(tok, text: str = "calc") -> Message:
    """A sampled MODEL turn (its content and the end-of-turn)."""
    return Message(text, M, token_ids=_ids(tok, text + "<|end|>"))


CANONICAL = {
    "tool_then_reply": lambda: [Message("Compute 3*9.", U), Message("calc", M), Message("27", T),
                                Message("It is 27.", M)],
    "result_also_in_the_reply": lambda: [Message("Compute 3*9.", U), Message("calc", M), Message("27", T),
                                         Message("The product is 27.", M)],
    "result_also_in_the_question": lambda: [Message("Compute 3*9, expect 27.", U), Message("calc", M),
                                            Message("27", T), Message("It is.", M)],
    "tool_is_last": lambda: [Message("Compute 3*9.", U), Message("calc", M), Message("27", T)],
    "empty_result": lambda: [Message("Compute 3*9.", U), Message("calc", M), Message("", T), Message("Hm.", M)],
    "whitespace_result": lambda: [Message("Compute 3*9.", U), Message("calc", M), Message("  ", T),
                                  Message("Hm.", M)],
}


@pytest.mark.parametrize("case", list(CANONICAL))
def test_phi35_tool_message_is_refused_in_canonical_encoding(case):
    tok = load("phi-3.5")
    with pytest.raises(ValueError, match=DROPS + r".*send tool results as user messages"):
        encode_rollout(Rollout(CANONICAL[case]()), tok)


@pytest.mark.parametrize("case", ["result_also_in_the_question", "tool_is_last"])
def test_phi35_tool_message_is_refused_in_a_prompt(case):
    tok = load("phi-3.5")
    messages = CANONICAL[case]()[:3]
    with pytest.raises(ValueError, match=DROPS):
        encode_prompt(Rollout(messages), tok)


SAMPLED = {
    "tool_then_turn": lambda tok: [Message("Compute 3*9.", U), _calc(tok), Message("27", T), _calc(tok, "It is 27.")],
    "tool_is_last": lambda tok: [Message("Compute 3*9.", U), _calc(tok), Message("27", T)],
    "result_text_is_the_previous_turn": lambda tok: [Message("Compute 3*9.", U), _calc(tok), Message("calc", T),
                                                     _calc(tok, "ok")],
    "result_also_in_a_later_user_turn": lambda tok: [Message("Compute 3*9.", U), _calc(tok), Message("27", T),
                                                     Message("Is it 27?", U), _calc(tok, "Yes.")],
    "empty_result": lambda tok: [Message("Compute 3*9.", U), _calc(tok), Message("", T), _calc(tok, "Hm.")],
}


@pytest.mark.parametrize("case", list(SAMPLED))
def test_phi35_tool_message_is_refused_as_sampled(case):
    tok = load("phi-3.5")
    messages = SAMPLED[case](tok)
    with pytest.raises(ValueError, match=DROPS):  # names the rollout's index, not the block's
        encode_rollout(Rollout(messages), tok)
    prompt = messages if messages[-1].type is not M else messages[:-1]
    with pytest.raises(ValueError, match=DROPS):
        encode_prompt(Rollout(prompt), tok)


def test_phi35_tool_results_as_user_messages_encode():
    """The fix the error names."""
    tok = load("phi-3.5")
    r = Rollout([Message("Compute 3*9.", U), _calc(tok), Message("27", U), _calc(tok, "It is 27.")])
    enc = encode_rollout(r, tok)
    assert "\n27<|end|>" in tok.decode(enc.input_ids)


@pytest.mark.parametrize("family", ["qwen2.5", "llama-3.1"])
def test_templates_with_a_tool_role_still_encode_results_written_elsewhere(family):
    """No false refusal: the result's text is also in the question and the reply; the tool turn is rendered."""
    tok = load(family)
    kwargs = {"chat_template_kwargs": {"date_string": "26 Jul 2024"}} if family.startswith("llama") else {}
    r = Rollout([Message("Compute 3*9, expect 27.", U), Message("calc", M), Message("27", T, tool_call_id="c1"),
                 Message("The product is 27.", M)], kwargs)
    enc = encode_rollout(r, tok)
    assert enc.input_ids == tok.apply_chat_template(r.to_chat(), tokenize=True, return_dict=False,
                                                    **kwargs.get("chat_template_kwargs", {}))
    sampled = Rollout([Message("Compute 3*9, expect 27.", U), Message("calc", M, token_ids=_ids(tok, "calc")),
                       Message("27", T, tool_call_id="c1")], kwargs)
    assert tok.decode(encode_prompt(sampled, tok)).count("27") == 2
