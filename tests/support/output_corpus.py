"""Model outputs per family, shared by the parser unit tests and the differential tests
against vLLM's parsers: plain text, one call, several calls, arguments with nested JSON
and unicode, reasoning, a reply cut off mid-call, and text that only looks like a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def tool(name: str, **props: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool.",
            "parameters": {"type": "object", "properties": props},
        },
    }


TOOLS = [
    tool(
        "get_weather", city={"type": "string"}, days={"type": "integer"}, metric={"type": "boolean"}
    ),
    tool(
        "search",
        query={"type": "string"},
        filters={"type": "object"},
        tags={"type": "array", "items": {"type": "string"}},
        limit={"type": "number"},
    ),
]


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    text: str
    """The decoded reply, as the gateway parses it."""
    calls: int
    """How many tool calls it holds."""


def _xml(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


HERMES = [
    Case("plain", "The weather is fine. Ünïcödé ☀️", 0),
    Case("one_call", _hermes("get_weather", '{"city": "Paris", "days": 3}'), 1),
    Case("content_then_call", "Let me check.\n" + _hermes("get_weather", '{"city": "Köln"}'), 1),
    Case(
        "two_calls",
        _hermes("get_weather", '{"city": "Paris"}')
        + "\n"
        + _hermes("search", '{"query": "rain", "filters": {"a": [1, {"b": null}]}}'),
        2,
    ),
    Case("unicode_args", _hermes("search", '{"query": "東京 ☔ \\"quoted\\""}'), 1),
    Case("truncated", 'Sure.\n<tool_call>\n{"name": "get_weather", "argu', 0),
    Case(
        "think_then_call",
        "<think>\nNeed the weather.\n</think>\n\n" + _hermes("get_weather", '{"city": "Paris"}'),
        1,
    ),
    Case("think_only", "<think>\nHmm 🤔\n</think>\n\nIt is sunny.", 0),
]

QWEN3_CODER = [
    Case("plain", "No tool needed. Ünïcödé ☀️", 0),
    Case("one_call", _xml("get_weather", city="Paris", days="3"), 1),
    Case("content_then_call", "Let me check.\n\n" + _xml("get_weather", city="Köln"), 1),
    Case(
        "two_calls",
        _xml("get_weather", city="Paris", metric="true")
        + "\n"
        + _xml(
            "search",
            query="rain",
            filters='{"a": [1, {"b": null}]}',
            tags='["x", "ü"]',
            limit="2.5",
        ),
        2,
    ),
    Case("multiline_value", _xml("search", query="line one\nline two ✓"), 1),
    Case("untyped_string_like_number", _xml("search", query="42"), 1),
    Case("truncated", "Sure.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", 0),
    Case(
        "think_then_call",
        "<think>\nNeed the weather.\n</think>\n\n" + _xml("get_weather", city="Paris"),
        1,
    ),
]

LLAMA3 = [
    Case("plain", "The weather is fine. Ünïcödé ☀️", 0),
    Case("one_call", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', 1),
    Case("arguments_key", '{"name": "get_weather", "arguments": {"city": "Paris"}}', 1),
    Case(
        "two_calls",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "search", "parameters": {"query": "東京", "filters": {"a": [1, {"b": null}]}}}',
        2,
    ),
    Case("compact_json", '{"name":"search","parameters":{"query":"☔ \\"q\\""}}', 1),
    Case("truncated", '{"name": "get_weather", "parameters": {"city": "Pa', 0),
    Case("json_in_prose", 'Use {"name": "get_weather", "parameters": {"city": "Paris"}} later.', 0),
]
"""`json_in_prose`: a call only for vLLM (see `DIFFERENT_BY_DESIGN`)."""

MISTRAL = [
    Case("plain", "The weather is fine. Ünïcödé ☀️", 0),
    Case("one_call", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', 1),
    Case("content_then_call", 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Köln"}', 1),
    Case(
        "two_calls",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]'
        '{"query": "東京 ☔", "filters": {"a": [1, {"b": null}]}}',
        2,
    ),
    Case("compact_json", '[TOOL_CALLS]search[ARGS]{"query":"\\"q\\""}', 1),
    Case("truncated", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', 0),
]
"""Mistral v11+ (`[TOOL_CALLS]NAME[ARGS]{...}`)."""

MAGISTRAL = [
    Case("think_then_content", "[THINK]Weather? Ünïcödé.[/THINK]It is sunny.", 0),
    Case(
        "think_then_call",
        '[THINK]Need it.[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
        1,
    ),
    Case("no_think", "Sunny.", 0),
]
"""Magistral (`[THINK]...[/THINK]`, then Mistral v11 calls)."""

MISTRAL_V3 = [
    Case("plain", "Fine. ☀️", 0),
    Case("one_call", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', 1),
    Case(
        "two_calls",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "search", "arguments": {"query": "東京", "filters": {"a": [1]}}}]',
        2,
    ),
    Case("truncated", '[TOOL_CALLS][{"name": "get_weather", "argu', 0),
]
"""Mistral pre-v11 (`[TOOL_CALLS][{...}, ...]`, Mistral 7B v0.3, NeMo)."""

_DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
_DS31_CALL = "<｜tool▁call▁begin｜>{}<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
_DS_BEGIN, _DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"

DEEPSEEK_V3 = [
    Case("plain", "The weather is fine. Ünïcödé ☀️", 0),
    Case(
        "one_call",
        _DS_BEGIN + _DS_CALL.format("get_weather", '{"city": "Paris", "days": 3}') + _DS_END,
        1,
    ),
    Case(
        "content_then_call",
        "Let me check." + _DS_BEGIN + _DS_CALL.format("get_weather", '{"city": "Köln"}') + _DS_END,
        1,
    ),
    Case(
        "two_calls",
        _DS_BEGIN
        + _DS_CALL.format("get_weather", '{"city": "Paris"}')
        + "\n"
        + _DS_CALL.format("search", '{"query": "東京 ☔", "filters": {"a": [1, {"b": null}]}}')
        + _DS_END,
        2,
    ),
    Case("truncated", "Sure." + _DS_BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_w", 0),
]

DEEPSEEK_V31 = [
    Case("plain", "The weather is fine. Ünïcödé ☀️", 0),
    Case(
        "one_call",
        _DS_BEGIN + _DS31_CALL.format("get_weather", '{"city": "Paris", "days": 3}') + _DS_END,
        1,
    ),
    Case(
        "content_then_call",
        "Let me check."
        + _DS_BEGIN
        + _DS31_CALL.format("get_weather", '{"city": "Köln"}')
        + _DS_END,
        1,
    ),
    Case(
        "two_calls",
        _DS_BEGIN
        + _DS31_CALL.format("get_weather", '{"city": "Paris"}')
        + _DS31_CALL.format("search", '{"query": "東京 ☔", "filters": {"a": [1, {"b": null}]}}')
        + _DS_END,
        2,
    ),
    Case(
        "truncated", "Sure." + _DS_BEGIN + '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"ci', 0
    ),
]

_KIMI_CALL = "<|tool_call_begin|>functions.{}:{}<|tool_call_argument_begin|>{}<|tool_call_end|>"
_KIMI_BEGIN, _KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"

KIMI_K2 = [
    Case("plain", "The weather is fine. Ünïcödé ☀️", 0),
    Case(
        "one_call",
        _KIMI_BEGIN + _KIMI_CALL.format("get_weather", 0, '{"city": "Paris"}') + _KIMI_END,
        1,
    ),
    Case(
        "content_then_call",
        "Let me check."
        + _KIMI_BEGIN
        + _KIMI_CALL.format("get_weather", 0, '{"city": "Köln", "days": 3}')
        + _KIMI_END,
        1,
    ),
    Case(
        "two_calls",
        _KIMI_BEGIN
        + _KIMI_CALL.format("get_weather", 0, '{"city": "Paris"}')
        + _KIMI_CALL.format("search", 1, '{"query": "東京", "filters": {"a": [1, {"b": null}]}}')
        + _KIMI_END,
        2,
    ),
    Case(
        "truncated",
        "Sure." + _KIMI_BEGIN + "<|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"ci',
        0,
    ),
]

LLAMA4_PYTHONIC = [
    Case("plain", "The weather is fine. Ünïcödé ☀️", 0),
    Case("one_call", '[get_weather(city="Paris", days=3)]', 1),
    Case(
        "two_calls",
        "[get_weather(city='Paris', metric=True), search(query=\"東京 ☔\", "
        'filters={"a": [1, {"b": None}]}, limit=-2.5)]',
        2,
    ),
    Case("wrapped", '<|python_start|>[get_weather(city="Köln")]<|python_end|>', 1),
    Case("json_names", '[search(query="x", filters={"on": true, "off": null})]', 1),
    Case("truncated", '[get_weather(city="Pa', 0),
    Case("list_in_prose", "[1, 2] are numbers", 0),
]


def _glm(name: str, **args: str) -> str:
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{body}</tool_call>"


GLM45 = [
    Case("plain", "The weather is fine. Ünïcödé ☀️", 0),
    Case("one_call", _glm("get_weather", city="Paris", days="3"), 1),
    Case("content_then_call", "Let me check.\n" + _glm("get_weather", city="Köln"), 1),
    Case(
        "two_calls",
        _glm("get_weather", city="Paris", metric="true")
        + "\n"
        + _glm("search", query="東京 ☔", filters='{"a": [1, {"b": null}]}', tags='["x"]'),
        2,
    ),
    Case(
        "compact_47",
        "<tool_call>search<arg_key>query</arg_key><arg_value>rain</arg_value></tool_call>",
        1,
    ),
    Case(
        "think_then_call",
        "<think>Need the weather.</think>\n" + _glm("get_weather", city="Paris"),
        1,
    ),
    Case("truncated", "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_va", 0),
]

_A = "<|channel|>analysis<|message|>{}<|end|>"
_F = "<|start|>assistant<|channel|>final<|message|>{}<|return|>"
_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"
)

GPT_OSS = [
    Case("final_only", "<|channel|>final<|message|>It is sunny ☀️.<|return|>", 0),
    Case("reasoning_then_final", _A.format("User asks weather. Ünïcödé.") + _F.format("Sunny."), 0),
    Case(
        "reasoning_then_call",
        _A.format("Need the weather.")
        + _CALL.format("get_weather", '{"city": "Paris", "days": 3}'),
        1,
    ),
    Case(
        "call_recipient_first",
        _A.format("Search.") + "<|start|>assistant to=functions.search"
        '<|channel|>commentary json<|message|>{"query": "東京 ☔", "filters": {"a": [1]}}'
        "<|call|>",
        1,
    ),
    Case(
        "preamble_then_call",
        _A.format("Plan.") + "<|start|>assistant<|channel|>commentary"
        "<|message|>Checking the weather.<|end|>" + _CALL.format("get_weather", '{"city": "Köln"}'),
        1,
    ),
    Case(
        "call_ended_by_stop_token",
        _A.format("Weather.") + "<|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
        1,
    ),
    Case("final_ended_by_stop_token", "<|channel|>final<|message|>Sunny.", 0),
    Case("cut_in_reasoning", "<|channel|>analysis<|message|>Thinking about", 0),
    Case("cut_in_final", _A.format("Ok.") + "<|start|>assistant<|channel|>final<|message|>Sun", 0),
]

QWEN3_THINKING = [
    Case("reasoning_then_content", "Let me think 🤔.\n</think>\n\nIt is 5.", 0),
    Case(
        "reasoning_then_call",
        "Need the weather.\n</think>\n\n" + _hermes("get_weather", '{"city": "Paris"}'),
        1,
    ),
    Case("cut_in_reasoning", "Still thinking about Köln", 0),
    Case("open_repeated", "<think>\nHmm.\n</think>\n\nOK.", 0),
]
"""Replies after a generation prompt that opened `<think>` (Qwen3 thinking-2507)."""

FAMILIES: dict[str, list[Case]] = {
    "hermes": HERMES,
    "qwen3_coder": QWEN3_CODER,
    "llama3_json": LLAMA3,
    "qwen3_thinking": QWEN3_THINKING,
    "mistral": MISTRAL,
    "mistral_v3": MISTRAL_V3,
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v31": DEEPSEEK_V31,
    "kimi_k2": KIMI_K2,
    "llama4_pythonic": LLAMA4_PYTHONIC,
    "glm45": GLM45,
    "gpt_oss": GPT_OSS,
    "magistral": MAGISTRAL,
}
"""Family -> its corpus."""
FAMILY_PARSERS: dict[str, tuple[str, str]] = {
    "hermes": ("hermes", ""),
    "qwen3_coder": ("qwen3_coder", ""),
    "llama3_json": ("llama3_json", ""),
    "qwen3_thinking": ("hermes", "<|im_start|>assistant\n<think>\n"),
    "mistral": ("mistral", ""),
    "mistral_v3": ("mistral", ""),
    "deepseek_v3": ("deepseek_v3", ""),
    "deepseek_v31": ("deepseek_v31", ""),
    "kimi_k2": ("kimi_k2", ""),
    "llama4_pythonic": ("llama4_pythonic", ""),
    "glm45": ("glm45", ""),
    "gpt_oss": ("gpt_oss", ""),
    "magistral": ("mistral", ""),
}
"""Family -> (`gateway.tool_parser`, the end of its template's generation prompt)."""
