"""Tool-call / reasoning parsing of generated text (pure strings, no tokenizer)."""

from __future__ import annotations

import json

import pytest

from gateway.toolparse import ParsedText, parse_output, tool_call_id


def parse(text: str, tools: bool = True, final: bool = True) -> ParsedText:
    return parse_output(text, parse_tools=tools, id_seed="chatcmpl-x:0", final=final)


def block(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def test_plain_text_is_content() -> None:
    assert parse("Hello there.") == ParsedText("Hello there.", None, ())


def test_single_call_keeps_exact_argument_text() -> None:
    args = '{"b": 2,   "a": [1, {"x": "}"}]}'
    out = parse(block("add", args))
    assert out.content == ""
    assert len(out.tool_calls) == 1
    call = out.tool_calls[0]
    assert (call.name, call.arguments) == ("add", args)  # raw slice, not json.dumps
    assert json.loads(call.arguments) == {"b": 2, "a": [1, {"x": "}"}]}
    assert call.id == tool_call_id("chatcmpl-x:0", 0)
    assert call.id.startswith("call_") and len(call.id) == 5 + 24


def test_two_calls_and_leading_content_strip_template_separators() -> None:
    text = "Let me add.\n" + block("add", '{"a": 1}') + "\n" + block("mul", '{"a": 2}')
    out = parse(text)
    assert out.content == "Let me add."
    assert [c.name for c in out.tool_calls] == ["add", "mul"]
    assert [c.arguments for c in out.tool_calls] == ['{"a": 1}', '{"a": 2}']
    assert out.tool_calls[0].id != out.tool_calls[1].id


def test_ids_are_deterministic_per_seed_and_index() -> None:
    a = parse(block("f", "{}")).tool_calls[0].id
    assert a == parse(block("f", "{}")).tool_calls[0].id
    other = parse_output(block("f", "{}"), parse_tools=True, id_seed="chatcmpl-x:1")
    assert other.tool_calls[0].id != a


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "add", "arguments": {"a": 1}',  # unbalanced
        '{"name": "add", "arguments": {"a": 1}} trailing',  # garbage after the object
        '{"arguments": {"a": 1}}',  # no name
        '{"name": 3, "arguments": {}}',  # name not a string
        '{"name": "add", "arguments": [1, 2]}',  # arguments not an object
        "not json at all",
    ],
)
def test_malformed_block_stays_content(body: str) -> None:
    text = f"Before\n<tool_call>\n{body}\n</tool_call>"
    out = parse(text)
    assert out.tool_calls == ()
    assert out.content == text


def test_malformed_block_between_valid_calls() -> None:
    bad = "<tool_call>\n{oops}\n</tool_call>"
    text = block("a", "{}") + "\n" + bad + "\n" + block("b", "{}")
    out = parse(text)
    assert [c.name for c in out.tool_calls] == ["a", "b"]
    assert out.content == "\n" + bad


def test_unclosed_block_at_the_end_is_content() -> None:
    text = 'Hi\n<tool_call>\n{"name": "add", "argu'
    assert parse(text) == ParsedText(text, None, ())


def test_arguments_missing_or_given_as_string() -> None:
    assert parse('<tool_call>\n{"name": "now"}\n</tool_call>').tool_calls[0].arguments == "{}"
    encoded = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    assert parse(encoded).tool_calls[0].arguments == '{"a": 1}'


def test_think_then_content_then_call() -> None:
    text = "<think>\nI should add.\n</think>\n\nSure.\n" + block("add", '{"a": 1}')
    out = parse(text)
    assert out.reasoning == "I should add."
    assert out.content == "Sure."
    assert out.tool_calls[0].name == "add"


def test_think_only_and_unclosed_think() -> None:
    assert parse("<think>\nx\n</think>\n\nAnswer") == ParsedText("Answer", "x", ())
    assert parse("<think>\nstill thinking") == ParsedText("", "still thinking", ())
    assert parse("<think>\n\n</think>\n\nA").reasoning is None


def test_no_tools_offered_leaves_markup_in_content() -> None:
    text = "<think>\nr\n</think>\n\n" + block("add", "{}")
    out = parse(text, tools=False)
    assert out.tool_calls == ()
    assert out.reasoning == "r"
    assert out.content == block("add", "{}")


SAMPLES = [
    "Plain answer with <tags> and a < sign\n",
    "<think>\nplan: call add\n</think>\n\nOK.\n" + block("add", '{"a": 1, "b": 2}'),
    block("a", '{"x": "</tool_call>?"}') + "\n" + block("b", "{}") + "\ntrailing",
    "Text\n<tool_call>\n{broken}\n</tool_call>\nmore\n<tool_ca",
    "<thi not a think tag",
    "<think>\nunfinished </thin",
    "<think>\nx\n</think>\n",
]


@pytest.mark.parametrize("text", SAMPLES)
@pytest.mark.parametrize("tools", [True, False])
def test_partial_parses_are_prefixes_of_the_final_parse(text: str, tools: bool) -> None:
    final = parse(text, tools=tools)
    seen_calls = 0
    for cut in range(len(text) + 1):
        part = parse(text[:cut], tools=tools, final=False)
        assert final.content.startswith(part.content), (cut, part)
        assert (final.reasoning or "").startswith(part.reasoning or ""), (cut, part)
        assert final.tool_calls[: len(part.tool_calls)] == part.tool_calls
        assert len(part.tool_calls) >= seen_calls
        seen_calls = len(part.tool_calls)


def test_partial_markers_are_held_back() -> None:
    assert parse("Hello <tool", final=False).content == "Hello "
    assert parse("Hello\n", final=False).content == "Hello"
    assert parse("<thi", final=False) == ParsedText("", None, ())
    assert parse("<think>\nabc\n</thi", final=False).reasoning == "abc"
    assert parse('A\n<tool_call>\n{"name": "f"', final=False).content == "A"
