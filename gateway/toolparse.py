"""Parses generated text into (content, reasoning_content, tool_calls): Qwen/Hermes
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks and a leading
`<think>...</think>`. Pure strings, no tokens or HTTP. The parse inverts what
`areal_service/chat_template.jinja` renders for an assistant message (separators, raw
argument text), so a re-rendered reply reproduces the generated text exactly.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_THINK_HELD = ("\n" + THINK_CLOSE, THINK_CLOSE)
_TOOL_HELD = ("\n" + TOOL_OPEN, TOOL_OPEN)

_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the model made; `arguments` is the model's exact JSON text."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """Chat Completions wire form (`message.tool_calls[i]`)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedText:
    """The parts of one generated text. `content` is "" when there is none."""

    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]


def tool_call_id(seed: str, index: int) -> str:
    """`call_<24 hex>`, deterministic for (completion/choice seed, call index), so a
    streamed and a non-streamed rendering of the same output agree."""
    return "call_" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]


def parse_output(text: str, *, parse_tools: bool, id_seed: str, final: bool = True) -> ParsedText:
    """Split generated text into reasoning, content and tool calls.

    With `final=False` the text is a prefix of a longer generation: the result holds back
    anything a continuation could still change (a partial marker, a separator newline, an
    unclosed `<tool_call>` block), so every partial result's content and reasoning are
    prefixes of the final ones, and its tool calls a prefix of the final list.
    """
    reasoning, rest = _split_reasoning(text, final)
    if reasoning is None and not final and _is_proper_prefix(text, THINK_OPEN):
        return ParsedText("", None, ())
    if not parse_tools:
        return ParsedText(rest, reasoning, ())
    content, calls = _split_tool_calls(rest, final, id_seed)
    return ParsedText(content, reasoning, calls)


def _split_reasoning(text: str, final: bool) -> tuple[str | None, str]:
    """(reasoning or None, text after the think block). Inverts the template's
    `<think>\\n{reasoning}\\n</think>\\n\\n{content}`; only a leading block counts."""
    if not text.startswith(THINK_OPEN):
        return None, text
    close = text.find(THINK_CLOSE, len(THINK_OPEN))
    body = text[len(THINK_OPEN):] if close < 0 else text[len(THINK_OPEN):close]
    body = body.removeprefix("\n")
    if close < 0:
        if not final:
            body = body[: len(body) - held_suffix(body, _THINK_HELD)]
        return body or None, ""
    rest = text[close + len(THINK_CLOSE):]
    if not final and rest in ("", "\n"):
        rest = ""  # cannot tell yet whether the "\n\n" separator follows
    else:
        rest = rest.removeprefix("\n\n")
    return body.removesuffix("\n") or None, rest


def _split_tool_calls(text: str, final: bool, id_seed: str) -> tuple[str, tuple[ToolCall, ...]]:
    """Content with valid `<tool_call>` blocks (and the one "\\n" the template puts before
    each) cut out; malformed or unclosed blocks stay in the content verbatim."""
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while True:
        start = text.find(TOOL_OPEN, pos)
        if start < 0:
            tail = text[pos:]
            if not final:
                tail = tail[: len(tail) - held_suffix(tail, _TOOL_HELD)]
            content.append(tail)
            break
        segment = text[pos:start]
        end = text.find(TOOL_CLOSE, start + len(TOOL_OPEN))
        if end < 0:
            # Unclosed: final means truncated (keep it as text); otherwise wait for it.
            content.append(segment + text[start:] if final else segment.removesuffix("\n"))
            break
        block_end = end + len(TOOL_CLOSE)
        parsed = _parse_block(text[start + len(TOOL_OPEN):end])
        if parsed is None:
            content.append(segment + text[start:block_end])
        else:
            content.append(segment.removesuffix("\n"))
            name, arguments = parsed
            calls.append(ToolCall(tool_call_id(id_seed, len(calls)), name, arguments))
        pos = block_end
    return "".join(content), tuple(calls)


def _parse_block(block: str) -> tuple[str, str] | None:
    """(name, raw arguments JSON text) of one block's `{"name", "arguments"}` object, or
    None when it is not exactly one such object."""
    raw = block.strip()
    spans = _top_level_spans(raw)
    if spans is None or "name" not in spans:
        return None
    name = json.loads(raw[slice(*spans["name"])])
    if not isinstance(name, str):
        return None
    if "arguments" not in spans:
        return name, "{}"
    args_raw = raw[slice(*spans["arguments"])]
    args = json.loads(args_raw)
    if isinstance(args, dict):
        return name, args_raw  # the model's exact text: re-renders to the same tokens
    if isinstance(args, str):
        return name, args  # arguments sent as a JSON-encoded string
    return None


def _top_level_spans(raw: str) -> dict[str, tuple[int, int]] | None:
    """Span of each top-level value of the JSON object `raw`, or None if `raw` is not
    exactly one JSON object. `JSONDecoder.raw_decode` gives exact value boundaries."""
    if not raw.startswith("{"):
        return None
    spans: dict[str, tuple[int, int]] = {}
    pos = _WS.match(raw, 1).end()
    if raw.startswith("}", pos):
        return spans if pos + 1 == len(raw) else None
    while True:
        try:
            key, pos = _DECODER.raw_decode(raw, pos)
            pos = _WS.match(raw, pos).end()
            if not raw.startswith(":", pos) or not isinstance(key, str):
                return None
            start = _WS.match(raw, pos + 1).end()
            _, end = _DECODER.raw_decode(raw, start)
        except json.JSONDecodeError:
            return None
        spans[key] = (start, end)
        pos = _WS.match(raw, end).end()
        if raw.startswith(",", pos):
            pos = _WS.match(raw, pos + 1).end()
        elif raw.startswith("}", pos):
            return spans if pos + 1 == len(raw) else None
        else:
            return None


def held_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`:
    the characters a streaming parser must hold back until it knows what follows.
    Only positions holding a marker's first character are tried (this runs per token)."""
    best = 0
    for marker in markers:
        if not marker:
            continue
        pos = text.find(marker[0], max(0, len(text) - len(marker) + 1))
        while pos >= 0 and len(text) - pos > best:
            if marker.startswith(text[pos:]):
                best = len(text) - pos  # the earliest match is this marker's longest
                break
            pos = text.find(marker[0], pos + 1)
    return best


def _is_proper_prefix(text: str, marker: str) -> bool:
    return len(text) < len(marker) and marker.startswith(text)
