"""Qwen2.5 / Hermes tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
blocks anywhere in the content. The parse inverts what the family's templates (and the
project's `builtin:chatml-tools`) render for an assistant message: the one "\n" before
each block is template framing, and the arguments keep the model's exact text, so a
replayed reply re-renders to the generated text. Malformed or (finally) unclosed blocks
stay in the content verbatim.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from gateway.toolparse.base import (
    OpenCall,
    ToolCall,
    ToolFormat,
    held_suffix,
    tool_call_id,
    whitespace_run,
)

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_HELD = ("\n" + TOOL_OPEN, TOOL_OPEN)

_WS = whitespace_run(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
"""A block's start up to its arguments object, the name first (as the templates write
it): from there the arguments stream as they are generated."""


def open_block_body(text: str) -> int | None:
    """Where the last `<tool_call>` block's body starts while that block is still open
    (no `</tool_call>` after it yet); None when no block is open."""
    start = text.rfind(TOOL_OPEN)
    if start < 0 or text.find(TOOL_CLOSE, start) >= 0:
        return None
    return start + len(TOOL_OPEN)


class TaggedToolFormat(ToolFormat):
    """Calls in `<tool_call>...</tool_call>` blocks; subclasses say how a block's body
    reads (`parse_block`)."""

    markers: ClassVar[tuple[str, ...]] = TOOL_HELD

    def split(
        self, text: str, final: bool, id_seed: str, tools: Sequence[Mapping[str, Any]] | None
    ) -> tuple[str, tuple[ToolCall, ...]]:
        return _split_tool_calls(text, final, id_seed, lambda b: self.parse_block(b, tools))

    def parse_block(
        self, block: str, tools: Sequence[Mapping[str, Any]] | None
    ) -> tuple[str, str] | None:
        """(name, arguments JSON text) of one block's body, None when malformed."""
        raise NotImplementedError

    def plain_prefix(self, text: str, scan: int) -> tuple[str, int] | None:
        if text.find(TOOL_OPEN, scan) >= 0:
            return None
        return (
            text[: len(text) - held_suffix(text, TOOL_HELD)],
            max(0, len(text) - len(TOOL_OPEN) + 1),
        )


class HermesToolFormat(TaggedToolFormat):
    name: ClassVar[str] = "hermes"

    def open_call(
        self, text: str, done: int, tools: Sequence[Mapping[str, Any]] | None
    ) -> OpenCall | None:
        body = open_block_body(text)
        head = None if body is None else _HEAD.match(text, body)
        if head is None:
            return None  # not yet, or arguments first / as a string: the call comes whole
        try:
            name = json.loads(head.group(1))
        except ValueError:
            return None
        return OpenCall(done, None, name, head.end())

    def parse_block(
        self, block: str, tools: Sequence[Mapping[str, Any]] | None
    ) -> tuple[str, str] | None:
        return _parse_block(block)


def _split_tool_calls(
    text: str, final: bool, id_seed: str, parse_block: Callable[[str], tuple[str, str] | None]
) -> tuple[str, tuple[ToolCall, ...]]:
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
                tail = tail[: len(tail) - held_suffix(tail, TOOL_HELD)]
            content.append(tail)
            break
        segment = text[pos:start]
        end = text.find(TOOL_CLOSE, start + len(TOOL_OPEN))
        if end < 0:
            # Unclosed: final means truncated (keep it as text); otherwise wait for it.
            content.append(segment + text[start:] if final else segment.removesuffix("\n"))
            break
        block_end = end + len(TOOL_CLOSE)
        parsed = parse_block(text[start + len(TOOL_OPEN) : end])
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
