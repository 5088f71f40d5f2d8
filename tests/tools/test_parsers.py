"""Tool-call parsers: exact cases for each format, and hypothesis fuzzing (never raise, round-trip)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from SimpleTorchLLMRL.chat.message import Message, MessageType
from SimpleTorchLLMRL.tools import calculator
from SimpleTorchLLMRL.tools.parsers import (
    CodeBlockParser,
    JsonToolCallParser,
    TagToolCallParser,
    ToolCall,
    calls_from_openai,
    format_json_call,
    parse_tool_calls,
)
from SimpleTorchLLMRL.tools.registry import ToolRegistry

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PARSERS = [JsonToolCallParser(), TagToolCallParser(["calculator", "search"]), CodeBlockParser()]

# ---- JSON <tool_call> ---------------------------------------------------------------------------------


def test_json_single_call_with_span():
    text = 'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call> ok'
    (call,) = JsonToolCallParser().parse(text)
    assert call == ToolCall("calculator", arguments={"expression": "2+3"})
    assert text[call.span[0]: call.span[1]].startswith("<tool_call>")
    assert text[call.span[0]: call.span[1]].endswith("</tool_call>")


def test_json_several_blocks_objects_and_lists_keep_order():
    text = (format_json_call("a", {"x": 1}) + " mid "
            + '<tool_call>{"name": "b", "arguments": {}}\n{"name": "c", "arguments": {"y": [1, 2]}}</tool_call>'
            + '<tool_call>[{"name": "d"}, {"name": "e", "arguments": null}]</tool_call>')
    calls = JsonToolCallParser().parse(text)
    assert [c.name for c in calls] == ["a", "b", "c", "d", "e"]
    assert [c.arguments for c in calls] == [{"x": 1}, {}, {"y": [1, 2]}, {}, {}]
    assert all(c.error is None for c in calls)


@pytest.mark.parametrize("body, fragment", [
    ('{"name": "calc", "arguments": {"expression": "1+1"', "malformed tool call JSON"),
    ("", "malformed tool call JSON"),
    ('{"arguments": {}}', "no 'name'"),
    ('{"name": "", "arguments": {}}', "no 'name'"),
    ('{"name": 3}', "no 'name'"),
    ('"just a string"', "must be a JSON object"),
    ("[]", "must be a JSON object"),
    ('{"name": "calc", "arguments": [1, 2]}', "must be a JSON object, got list"),
    ('{"name": "calc", "arguments": "{not json"}', "not valid JSON"),
])
def test_json_bad_bodies_become_error_calls(body, fragment):
    (call,) = JsonToolCallParser().parse(f"<tool_call>{body}</tool_call>")
    assert call.error is not None and fragment in call.error


def test_json_openai_shapes_and_fenced_body():
    text = ('<tool_call>{"type": "function", "function": {"name": "f", "arguments": "{\\"a\\": 1}"}}</tool_call>'
            '<tool_call>\n```json\n{"name": "g", "parameters": {"b": 2}}\n```\n</tool_call>')
    calls = JsonToolCallParser().parse(text)
    assert [(c.name, c.arguments) for c in calls] == [("f", {"a": 1}), ("g", {"b": 2})]


def test_json_unclosed_counts_only_when_valid():
    p = JsonToolCallParser()
    assert [c.name for c in p.parse('x <tool_call>{"name": "f", "arguments": {}}')] == ["f"]
    assert p.parse('x <tool_call>{"name": "f", "argu') == []  # truncated generation: no call, no error
    assert JsonToolCallParser(allow_unclosed=False).parse('<tool_call>{"name": "f"}') == []


def test_structured_tool_calls_on_a_message_win():
    reg = ToolRegistry([calculator])
    msg = Message("no tags here", MessageType.MODEL, tool_calls=[
        {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}}])
    (call,) = reg.parse(msg)
    assert (call.name, call.arguments) == ("calculator", {"expression": "6*7"})
    assert calls_from_openai([{"name": "x", "arguments": {"k": 1}}])[0].arguments == {"k": 1}


# ---- tags and code blocks ---------------------------------------------------------------------------


def test_tags_strip_body_and_only_known_tags():
    text = "a <search> who wrote Hamlet </search> b <answer>x</answer> <calculator>2**10</calculator>"
    calls = TagToolCallParser(["calculator", "search"]).parse(text)
    assert [(c.name, c.text, c.arguments) for c in calls] == [
        ("search", "who wrote Hamlet", None), ("calculator", "2**10", None)]


def test_tags_unclosed_and_mismatched():
    p = TagToolCallParser(["search"])
    assert p.parse("<search>open but never closed") == []
    assert [c.text for c in TagToolCallParser(["search"], allow_unclosed=True).parse("<search>q")] == ["q"]
    assert p.parse("<search>a</calculator>") == []
    with pytest.raises(ValueError, match="identifiers"):
        TagToolCallParser(["bad tag"])


def test_code_blocks_languages_and_indentation():
    text = ("Try:\n```python\n\nfor i in range(2):\n    print(i)\n```\nthen\n```py\nprint(1)\n```"
            "\n```bash\nls\n```\n```PYTHON\nx=1\n```")
    calls = CodeBlockParser().parse(text)
    assert [c.text for c in calls] == ["for i in range(2):\n    print(i)", "print(1)", "x=1"]
    assert {c.name for c in calls} == {"python"}
    assert CodeBlockParser().parse("```python\nprint(1)\n") == []  # not closed


def test_merge_orders_by_position_and_drops_nested_calls():
    text = ("<calculator>1+1</calculator>\n```python\ns = '<tool_call>{\"name\": \"x\"}</tool_call>'\n```\n"
            + format_json_call("search", {"query": "q"}))
    calls = parse_tool_calls(text, PARSERS)
    assert [c.name for c in calls] == ["calculator", "python", "search"]


# ---- fuzzing -------------------------------------------------------------------------------------------

_pieces = st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"arguments"', "[", "]",
                           "<calculator>", "</calculator>", "<search>", "```python\n", "```", "\n", ",", '"'])
noisy_text = st.lists(st.one_of(st.text(max_size=20), _pieces), max_size=30).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
plain = st.text(max_size=40).filter(lambda s: "<" not in s and "`" not in s)


@FUZZ
@given(noisy_text)
def test_fuzz_parsers_never_raise_and_spans_are_ordered(text):
    for parser in PARSERS:
        for c in parser.parse(text):
            assert isinstance(c, ToolCall)
            assert 0 <= c.span[0] < c.span[1] <= len(text)
            if c.error is None:  # a well-formed call has a name and exactly one of arguments / text
                assert c.name and ((c.arguments is None) != (c.text is None))
            else:
                assert isinstance(c.error, str) and c.error
    merged = parse_tool_calls(text, PARSERS)
    assert [c.span[0] for c in merged] == sorted(c.span[0] for c in merged)


@FUZZ
@given(noisy_text)
def test_fuzz_registry_answers_every_call_and_never_raises(text):
    reg = ToolRegistry([calculator], formats=("json", "tags", "python"), max_calls=4, timeout=2)
    calls = reg.parse(text)
    msgs = reg.execute(calls)
    assert len(msgs) == min(len(calls), 4) + (len(calls) > 4)
    assert all(m.type is MessageType.TOOL and isinstance(m.content, str) for m in msgs)


@FUZZ
@given(names, st.dictionaries(st.text(max_size=8), json_values, max_size=4), plain, plain)
def test_fuzz_json_round_trip(name, args, before, after):
    text = before + format_json_call(name, args) + after
    (call,) = JsonToolCallParser().parse(text)
    assert call.error is None and call.name == name
    assert json.dumps(call.arguments, sort_keys=True) == json.dumps(args, sort_keys=True)


@FUZZ
@given(st.sampled_from(["calculator", "search"]), st.text(max_size=60).filter(lambda s: "</" not in s), plain)
def test_fuzz_tag_round_trip(tag, body, before):
    (call,) = [c for c in TagToolCallParser([tag]).parse(f"{before}<{tag}>{body}</{tag}>") if c.span[0] >= len(before)]
    assert call.name == tag and call.text == body.strip()


@FUZZ
@given(st.lists(st.text(alphabet="abc xyz=()+1\t", max_size=20), min_size=1, max_size=5), plain)
def test_fuzz_code_block_round_trip(lines, before):
    code = "\n".join(lines)
    (call,) = CodeBlockParser().parse(f"{before}\n```python\n{code}\n```\n")
    kept = list(lines)
    while kept and not kept[0].strip():  # leading blank lines go, indentation and inner lines stay
        kept.pop(0)
    assert call.text == "\n".join(kept).rstrip()


def test_last_closed_block_matches_a_full_parse_on_every_prefix():
    """The incremental tracker CodeTrigger uses agrees with CodeBlockParser.parse on growing texts."""
    import random

    from SimpleTorchLLMRL.tools.parsers import LastClosedBlock

    def reference(text):
        blocks = CodeBlockParser().parse(text)
        return blocks[-1].text if blocks and blocks[-1].span[1] >= len(text.rstrip()) else None

    pieces = ["```python\n", "```", "```py \n", "```bash\n", "`", "``", "x = 1\n", " ", "\n", "py", "thon", "\t\n"]
    rng = random.Random(0)
    for _ in range(300):
        tracker, text = LastClosedBlock(CodeBlockParser()), ""
        for _ in range(rng.randrange(1, 25)):
            piece = rng.choice(pieces)
            for cut in range(1, len(piece) + 1):  # growing one character at a time too
                assert tracker.code_at_end(text + piece[:cut]) == reference(text + piece[:cut]), repr(text + piece)
            text += piece
        assert tracker.code_at_end("```python\nfresh\n```") == "fresh"  # not an extension: rescanned
