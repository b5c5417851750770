"""Llama 3.1-3.3 (and Llama 4's `llama4_json`) JSON tool calls: the whole reply is the
call, `{"name": NAME, "parameters": {...}}` (`"arguments"` also accepted), several
separated by `;`. The family's templates render a replayed call as
`{"name": "NAME", "parameters": ARGS|tojson}`, so `template_arguments` gives the mapping.

By design narrower than vLLM's `llama3_json`, which also takes a JSON object out of the
middle of prose (and drops the prose): here a reply is a call only when, apart from
surrounding whitespace, it is nothing but calls, which is what the template renders and
what the model is trained to write; prose mentioning JSON stays content. Arguments keep
the model's exact text (vLLM re-serializes them; the values agree).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from gateway.toolparse.base import ToolCall, ToolFormat, tool_call_id, whitespace_run

_DECODER = json.JSONDecoder()
_WS = whitespace_run(r"\s*")
_SEPARATOR = re.compile(r"\s*;\s*")


class Llama3JsonToolFormat(ToolFormat):
    name: ClassVar[str] = "llama3_json"
    arguments_as_mapping: ClassVar[bool] = True

    def split(
        self, text: str, final: bool, id_seed: str, tools: Sequence[Mapping[str, Any]] | None
    ) -> tuple[str, tuple[ToolCall, ...]]:
        if not text.lstrip().startswith("{"):
            return text, ()
        if not final:
            return "", ()  # a call, or JSON-looking content: known only at the end
        calls = _calls(text, id_seed)
        return ("", calls) if calls else (text, ())

    def plain_prefix(self, text: str, scan: int) -> tuple[str, int] | None:
        if scan > 0:
            return text, scan  # decided: the reply did not start with a call
        head = text.lstrip()
        if not head:
            return "", 0  # undecided: held
        if head.startswith("{"):
            return None
        return text, 1


def _calls(text: str, id_seed: str) -> tuple[ToolCall, ...]:
    """The calls `text` consists of, or () when it is anything else."""
    calls: list[ToolCall] = []
    pos = _WS.match(text).end()
    while True:
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return ()
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ()
        key = "parameters" if "parameters" in obj else "arguments"
        args = obj.get(key, {})
        if not isinstance(args, dict):
            return ()
        calls.append(
            ToolCall(
                tool_call_id(id_seed, len(calls)),
                obj["name"],
                _raw_value(text, pos, end, key) or "{}",
            )
        )
        sep = _SEPARATOR.match(text, end)
        pos = sep.end() if sep else end
        if pos == len(text) or text[pos:].isspace():
            return tuple(calls)
        if sep is None:
            return ()  # something other than another call follows


def _raw_value(text: str, start: int, end: int, key: str) -> str | None:
    """The exact text of the top-level `key`'s value in the object text[start:end]."""
    obj = text[start:end]
    pos = _WS.match(obj, 1).end()
    while pos < len(obj) and obj[pos] != "}":
        name, pos = _DECODER.raw_decode(obj, pos)
        pos = _WS.match(obj, pos).end() + 1  # the ":"
        pos = _WS.match(obj, pos).end()
        _, value_end = _DECODER.raw_decode(obj, pos)
        if name == key:
            return obj[pos:value_end]
        pos = _WS.match(obj, value_end).end()
        if obj.startswith(",", pos):
            pos = _WS.match(obj, pos + 1).end()
    return None
