"""Mistral tool calls after the `[TOOL_CALLS]` special token, in both tokenizer
generations' forms:

- v11+ (Mistral Small 3.x, Devstral, Magistral): `[TOOL_CALLS]NAME[ARGS]{...}` per call
  (`NAME{...}` also read, as vLLM reads it);
- pre-v11 (Mistral 7B v0.3, NeMo): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

Content is the text before the first `[TOOL_CALLS]`, exactly (the templates write the
content and then the calls with nothing between). Arguments keep the model's JSON text:
the v11 templates write a string `arguments` verbatim after `[ARGS]`, so a replayed call
renders back to the generated text. A call has no closing marker, so the calls are read
when the reply ends (streamed: content as it comes, the calls with the last delta); a
`[TOOL_CALLS]` section that is not only well-formed calls stays content, whole.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from gateway.toolparse.base import (
    OpenCall,
    ToolCall,
    ToolFormat,
    held_suffix,
    tool_call_id,
    whitespace_run,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_DECODER = json.JSONDecoder()
_WS = whitespace_run(r"\s*")


class MistralToolFormat(ToolFormat):
    name: ClassVar[str] = "mistral"
    markers: ClassVar[tuple[str, ...]] = (TOOL_CALLS,)
    special_markers: ClassVar[bool] = True

    def split(
        self, text: str, final: bool, id_seed: str, tools: Sequence[Mapping[str, Any]] | None
    ) -> tuple[str, tuple[ToolCall, ...]]:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return (text if final else text[: len(text) - held_suffix(text, self.markers)]), ()
        if not final:
            return text[:start], ()
        calls = _calls(text, start, id_seed)
        return (text[:start], calls) if calls else (text, ())

    def open_call(
        self, text: str, done: int, tools: Sequence[Mapping[str, Any]] | None
    ) -> OpenCall | None:
        # v11's `NAME[ARGS]{...}` (the form the templates write): each call has its own
        # marker, so the last one is the call being generated, and the markers before it
        # count the calls before it (the partial parse completes none: a call has no end).
        start = text.rfind(TOOL_CALLS)
        if start < 0:
            return None
        name_at = start + len(TOOL_CALLS)
        args_at = text.find(ARGS, name_at)
        name = "" if args_at < 0 else text[name_at:args_at].strip()
        if not name or any(c.isspace() or c in "[{" for c in name):
            return None
        body = _WS.match(text, args_at + len(ARGS)).end()
        if not text.startswith("{", body):
            return None
        first = text.find(TOOL_CALLS)
        return OpenCall(text.count(TOOL_CALLS, first, start), None, name, body)

    def plain_prefix(self, text: str, scan: int) -> tuple[str, int] | None:
        if text.find(TOOL_CALLS, scan) >= 0:
            return None
        return (
            text[: len(text) - held_suffix(text, self.markers)],
            max(0, len(text) - len(TOOL_CALLS) + 1),
        )


def _calls(text: str, pos: int, id_seed: str) -> tuple[ToolCall, ...]:
    """The calls of the section `text[pos:]` (it starts with `[TOOL_CALLS]`), or () when
    the section is anything but calls (then it stays content)."""
    calls: list[tuple[str, str]] = []
    while pos < len(text):
        if not text.startswith(TOOL_CALLS, pos):
            if text[pos:].strip():
                return ()
            break
        pos = _WS.match(text, pos + len(TOOL_CALLS)).end()
        found = _array_calls(text, pos) if text.startswith("[", pos) else _named_call(text, pos)
        if found is None:
            return ()
        calls += found[0]
        pos = _WS.match(text, found[1]).end()
    return tuple(
        ToolCall(tool_call_id(id_seed, i), name, args) for i, (name, args) in enumerate(calls)
    )


def _named_call(text: str, pos: int) -> tuple[list[tuple[str, str]], int] | None:
    """v11+: `NAME[ARGS]{...}` or `NAME{...}` at `pos`: ([(name, arguments)], end)."""
    args_at = text.find(ARGS, pos)
    brace = text.find("{", pos)
    if args_at >= 0 and (brace < 0 or args_at < brace):
        name, body = text[pos:args_at], _WS.match(text, args_at + len(ARGS)).end()
    elif brace >= 0:
        name, body = text[pos:brace], brace
    else:
        return None
    name = name.strip()
    if not name or any(c.isspace() for c in name) or not text.startswith("{", body):
        return None
    try:
        _, end = _DECODER.raw_decode(text, body)
    except ValueError:
        return None
    return [(name, text[body:end])], end


def _array_calls(text: str, pos: int) -> tuple[list[tuple[str, str]], int] | None:
    """pre-v11: a JSON array of `{"name", "arguments"}` objects at `pos`."""
    try:
        items, end = _DECODER.raw_decode(text, pos)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not (
            isinstance(item, dict)
            and isinstance(item.get("name"), str)
            and isinstance(item.get("arguments", {}), dict)
        ):
            return None
        calls.append((item["name"], json.dumps(item.get("arguments", {}), ensure_ascii=False)))
    return calls, end
