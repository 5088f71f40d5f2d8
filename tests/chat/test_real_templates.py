"""Exact ids and masks on real chat templates and real vocabularies (tests/support/real_templates.py).

The expectations are derived without the encoder's logic:
- hand-written rollouts: ids are transformers' own `apply_chat_template(..., tokenize=True)`; the mask
  is 1 on the tokens (HF offsets) overlapping each assistant turn's span, located in the rendered text
  with the family's literal assistant header and end-of-turn strings (from the families' docs);
- sampled episodes: each prompt must start with the previous prompt plus the sampled ids; the ids must
  equal the whole as-sampled text tokenized in one piece (so no extra space markers); the text added
  after a sampled turn must be exactly the tail of the template's own rendering of the conversation;
  the mask is 1 on exactly the sampled ids.
Each case either matches those expectations or raises a ValueError that names the chat template; it
never returns wrong ids or a wrong mask.
"""

from __future__ import annotations

import dataclasses

import jinja2
import pytest

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt, encode_rollout
from tests.support.real_templates import FAMILIES, load

S, U, M, T = MessageType.SYSTEM, MessageType.MESSAGE, MessageType.MODEL, MessageType.TOOL

CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 3*9"}},
                   "required": ["expression"]}}}
TOOL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*9"}}\n</tool_call>'


def _call(content: str) -> Message:
    return Message(content, M, tool_calls=[{"type": "function", "id": "call00001",
                                            "function": {"name": "calculator", "arguments": {"expression": "3*9"}}}])


CASES = {
    "system_user_assistant": lambda: Rollout([Message("Be brief.", S), Message("What is 2 + 3?", U),
                                              Message("The answer is five.", M)]),
    "three_turns": lambda: Rollout([Message("Name a prime.", U), Message("Seven is prime.", M),
                                    Message("Another one?", U), Message("Eleven works too.", M),
                                    Message("And an even one?", U), Message("Only two qualifies.", M)]),
    "tool_call_as_text": lambda: Rollout([Message("Compute 3*9.", U), Message(TOOL_TEXT, M),
                                          Message("27", T, tool_call_id="call00001"),
                                          Message("The product is 27.", M)]),
    "structured_tool_call": lambda: Rollout([Message("Compute 3*9.", U), _call("Let me use the calculator."),
                                             Message("27", T, tool_call_id="call00001"),
                                             Message("The product is 27.", M)], {"tools": [CALC]}),
    "structured_tool_call_no_content": lambda: Rollout([Message("Compute 3*9.", U), _call(""),
                                                        Message("27", T, tool_call_id="call00001"),
                                                        Message("The product is 27.", M)], {"tools": [CALC]}),
    "whitespace_around_content": lambda: Rollout([Message("  What is 2 + 3?  ", U),
                                                  Message("  The answer is five.  \n", M)]),
    "reasoning_last_turn": lambda: Rollout([Message("What is 2 + 3?", U),
                                            Message("<think>\nTwo plus three.\n</think>\n\nThe answer is five.", M)]),
    "reasoning_earlier_turn": lambda: Rollout([Message("What is 2 + 3?", U),
                                               Message("<think>\nTwo plus three.\n</think>\n\nFive.", M),
                                               Message("Times two?", U), Message("That makes ten.", M)]),
    "thinking_off": lambda: Rollout([Message("What is 2 + 3?", U), Message("The answer is five.", M)],
                                    {"chat_template_kwargs": {"enable_thinking": False}}),
}


# ---------------------------------------------------------------------- the oracle


def _kwargs(fam, rollout) -> dict:
    return {**fam.kwargs, **(rollout.metadata.get("chat_template_kwargs") or {})}


def _render(tok, fam, rollout, chat=None, generation_prompt=False) -> str:
    return tok.apply_chat_template(chat if chat is not None else rollout.to_chat(), tokenize=False,
                                   tools=rollout.metadata.get("tools"), add_generation_prompt=generation_prompt,
                                   **_kwargs(fam, rollout))


class OracleCannot(Exception):
    """The rendering does not show the turn (content dropped or rewritten): the encoder must refuse."""


def _oracle_spans(fam, rollout, text: str) -> list[tuple[int, int]]:
    """Each trainable assistant turn: from the end of its header through its end-of-turn, found by literals.

    With thinking off the template's empty think block ends the prompt: it is not the model's text.
    """
    thinking_off = (rollout.metadata.get("chat_template_kwargs") or {}).get("enable_thinking") is False
    spans, pos = [], 0
    for msg in rollout:
        if not msg.is_trainable:
            continue
        assert msg.type is M, "the oracle locates assistant turns only"
        heads = [(i, i + len(h)) for h in fam.assistant_headers if (i := text.find(h, pos)) >= 0]
        assert heads, "oracle: no assistant header after the previous turn"
        start = min(heads)[1]
        if thinking_off and fam.thinking_off_prefix and text.startswith(fam.thinking_off_prefix, start):
            start += len(fam.thinking_off_prefix)
        content = msg.content.strip()
        nxt = [i for h in fam.assistant_headers if (i := text.find(h, start)) >= 0]
        limit = min(nxt) if nxt else len(text)
        c = text.find(content, start, limit) if content else start
        anchor = content
        if c >= 0 and msg.tool_calls:
            anchor = msg.tool_calls[0]["function"]["name"]
            c = text.find(anchor, c + len(content), limit)
        if c < 0:
            raise OracleCannot(f"{anchor!r} is not rendered in its turn")
        ends = [i + len(e) for e in fam.end_of_turn if (i := text.find(e, c + len(anchor))) >= 0]
        end = min(ends) if ends else c + len(anchor)
        spans.append((start, end))
        pos = end
    return spans


def _oracle(tok, fam, rollout) -> tuple[list[int], list[int]]:
    text = _render(tok, fam, rollout)
    ids = tok.apply_chat_template(rollout.to_chat(), tokenize=True, return_dict=False,
                                  tools=rollout.metadata.get("tools"), **_kwargs(fam, rollout))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids
    spans = _oracle_spans(fam, rollout, text)
    mask = [int(any(s < b and e > a for a, b in spans)) for s, e in enc["offset_mapping"]]
    return ids, mask


def hand_written_outcome(family: str, case: str) -> str:
    """'exact' or 'refused: <error>'; fails the test on a silently wrong result."""
    tok, fam = load(family), FAMILIES[family]
    rollout = CASES[case]()
    if fam.kwargs:
        rollout.metadata["chat_template_kwargs"] = {**fam.kwargs, **rollout.metadata.get("chat_template_kwargs", {})}
    try:
        want = _oracle(tok, fam, rollout)
    except (jinja2.TemplateError, TypeError, OracleCannot) as e:  # the template rejects or drops the turn
        cannot = e
    else:
        cannot = None
    try:
        enc = encode_rollout(rollout, tok)
    except ValueError as e:
        assert "chat template" in str(e), e
        return f"refused: {str(e)[:110]}"
    assert cannot is None, f"encoded a conversation whose turns cannot be trained exactly: {cannot}"
    assert enc.input_ids == want[0], f"{family}/{case}: ids differ from apply_chat_template"
    assert enc.loss_mask == want[1], (f"{family}/{case}: mask differs:\n"
                                      f"trained={tok.decode([i for i, m in zip(*want, strict=True) if m])!r}\n"
                                      f"ours={tok.decode([i for i, m in zip(enc.input_ids, enc.loss_mask, strict=True) if m])!r}")
    return "exact"


def _sampled_ids(tok, prompt_text: str, text: str) -> list[int]:
    """The ids a model would sample for `text` after this prompt: canonical in context."""
    whole = tok(prompt_text + text, add_special_tokens=False)["input_ids"]
    head = tok(prompt_text, add_special_tokens=False)["input_ids"]
    assert whole[: len(head)] == head, "oracle: the prompt's tokenization is not prefix-stable"
    return whole[len(head):]


def _template_tail(fam, canonical: str, reply: str, call: str) -> str:
    """The text after the last sampled reply's end-of-turn in the template's own rendering.

    Templates that render only the tool call of a turn with tool_calls are read after the call's arguments.
    """
    anchor = reply if reply in canonical else call
    at = canonical.rindex(anchor) + len(anchor)
    ends = [i + len(e) for e in fam.end_of_turn if (i := canonical.find(e, at)) >= 0]
    return canonical[min(ends):]


def sampled_episode(family: str, use_tool: bool = True, template_kwargs: dict | None = None) -> str:
    """Three sampled turns with a user turn and a tool (or user) turn between; checks every prompt.

    The oracle's text of the episode is built from strings only: the template's first prompt, each
    sampled text, and after it the tail of the template's own rendering of the conversation (without
    the system prompt, which some templates move to the last user turn); its ids are that text
    tokenized whole.
    """
    tok, fam = load(family), FAMILIES[family]
    if template_kwargs:
        fam = dataclasses.replace(fam, kwargs={**fam.kwargs, **template_kwargs})
    opts = {"chat_template_kwargs": dict(fam.kwargs)} if fam.kwargs else {}
    first = [Message("Be brief.", S)] if family != "gemma-2" else []
    r = Rollout(first + [Message("Compute 12 + 30.", U)], opts)
    replies = ["Twelve plus thirty is 42.", "Yes, I am sure it is 42.", "The tool agrees: 42."]
    between = [Message("Are you sure?", U),
               Message("42", T, tool_call_id="call00001") if use_tool else Message("Check with a tool.", U)]
    prompts, sampled, text = [], [], ""
    for k, reply in enumerate(replies):
        prompt = encode_prompt(r, tok)
        if k == 0:
            want = tok.apply_chat_template(r.to_chat(), tokenize=True, return_dict=False,
                                           add_generation_prompt=True, **fam.kwargs)
            assert prompt == want, f"{family}: first prompt differs from apply_chat_template"
            text = _render(tok, fam, r, generation_prompt=True)
        else:
            assert prompt[: len(prompts[-1]) + len(sampled[-1])] == prompts[-1] + sampled[-1], \
                f"{family}: prompt {k} does not extend prompt {k - 1} + its sampled ids"
            canonical = _render(tok, fam, r, [m for m in r.to_chat() if m["role"] != "system"], True)
            text += _template_tail(fam, canonical, replies[k - 1], "12+30")
            assert prompt == tok(text, add_special_tokens=False)["input_ids"], \
                f"{family}: prompt {k} is not the as-sampled text tokenized whole:\n" \
                f"{tok.decode(prompt[len(prompts[-1]) + len(sampled[-1]):])!r}\nvs {canonical[-120:]!r}"
        reply_text = fam.sampled_prefix + reply + fam.end_of_turn[0]
        ids = _sampled_ids(tok, text, reply_text)
        text += reply_text
        msg = Message(reply, M, token_ids=ids, logprobs=[-0.5] * len(ids), temperature=1.0)
        if k == 1 and use_tool:
            msg.tool_calls = [{"type": "function", "id": "call00001",
                               "function": {"name": "calculator", "arguments": {"expression": "12+30"}}}]
        prompts.append(prompt)
        sampled.append(ids)
        r.add_messages(msg)
        if k < 2:
            r.add_messages(between[k])
    enc = encode_rollout(r, tok)
    assert enc.input_ids == prompts[-1] + sampled[-1]
    trained = [0] * len(enc.input_ids)
    for k, ids in enumerate(sampled):
        start = len(prompts[k])
        assert enc.input_ids[start: start + len(ids)] == ids
        trained[start: start + len(ids)] = [1] * len(ids)
    assert enc.loss_mask == trained
    assert enc.message_index[len(prompts[-1]):] == [len(r) - 1] * len(sampled[-1])
    return "exact"


# ---------------------------------------------------------------------- the tests


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("case", list(CASES))
def test_hand_written_is_exact_or_refused(family, case):
    outcome = hand_written_outcome(family, case)
    assert outcome == "exact" or outcome.startswith("refused")


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma-2"])
def test_basic_conversation_is_exact(family):
    assert hand_written_outcome(family, "system_user_assistant") == "exact"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sampled_multi_turn_episode_is_exact(family):
    try:
        sampled_episode(family, use_tool=True)
    except ValueError as e:  # the template has no tool role: a user turn stands in
        assert "rejects" in str(e) or "drops TOOL" in str(e), e
        sampled_episode(family, use_tool=False)


@pytest.mark.parametrize("family", [f for f, fam in FAMILIES.items() if fam.thinking])
def test_sampled_episode_with_thinking_off_is_exact(family):
    assert sampled_episode(family, use_tool=True, template_kwargs={"enable_thinking": False}) == "exact"


@pytest.mark.parametrize("family", ["llama-3.1", "llama-3.2"])
def test_llama_tools_with_a_system_prompt(family):
    """Llama-3.1 puts tool definitions in the first user turn; a system prompt before it must not break that."""
    tok, fam = load(family), FAMILIES[family]
    r = Rollout([Message("Use tools when useful.", S), Message("Compute 3*9.", U), Message("It is 27.", M)],
                {"tools": [CALC], "chat_template_kwargs": dict(fam.kwargs)})
    want_ids, want_mask = _oracle(tok, fam, r)
    enc = encode_rollout(r, tok)
    assert (enc.input_ids, enc.loss_mask) == (want_ids, want_mask)
    prompt = Rollout(r.messages[:2], dict(r.metadata))
    assert encode_prompt(prompt, tok) == tok.apply_chat_template(
        prompt.to_chat(), tools=[CALC], add_generation_prompt=True, tokenize=True, return_dict=False, **fam.kwargs)


def matrix_table() -> str:
    """The README's table: `uv run python tests/chat/test_real_templates.py`."""
    rows = ["| family | vocabulary | " + " | ".join(CASES) + " | sampled episode |",
            "|---|---|" + "---|" * (len(CASES) + 1)]
    for family, fam in FAMILIES.items():
        cells = []
        for case in CASES:
            out = hand_written_outcome(family, case)
            cells.append("EXACT" if out == "exact" else "refused: " + _reason(out))
        try:
            sampled_episode(family, use_tool=True)
            episode = "EXACT (user + tool turns)"
        except ValueError:
            sampled_episode(family, use_tool=False)
            episode = "EXACT (user turns; no tool role)"
        rows.append(f"| {family} | {'real' if fam.real_vocab else 'stand-in'} | " + " | ".join(cells)
                    + f" | {episode} |")
    return "\n".join(rows)


def _reason(outcome: str) -> str:
    text = outcome.lower()
    for key, short in [("strips the reasoning", "strips reasoning"), ("drops its structured tool_calls", "drops tool_calls"),
                       ("renders only the tool_calls", "drops content of tool-call turn"),
                       ("drops tool messages", "drops tool messages"), ("rejects", "template rejects roles"),
                       ("rewrites", "rewrites content"), ("not one of its end-of-turn", "unknown turn end")]:
        if key in text:
            return short
    return outcome[9:60]


if __name__ == "__main__":
    print(matrix_table())
