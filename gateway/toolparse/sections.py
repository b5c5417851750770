"""Tool calls in a marked section of calls, each call between its own markers: DeepSeek
V3 and V3.1, Kimi K2. The markers are special tokens in these tokenizers' vocabularies
(replies are decoded keeping them, as vLLM does for Kimi).

    DeepSeek V3    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                   ```json
                   {ARGS}
                   ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    DeepSeek V3.1  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>...
    Kimi K2        <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:I
                   <|tool_call_argument_begin|>{ARGS}<|tool_call_end|>...<|tool_calls_section_end|>

Content is the text before the section, exactly (the templates write it, then the
section). Arguments keep the model's JSON text, which the templates write back verbatim
from a string; Kimi's call id (`functions.NAME:I`) is the call's id, as its template
writes the id back. Calls stream as each closes; whatever of the section does not read
as calls (a reply cut off mid-call) stays content, so nothing generated is dropped.
"""

from __future__ import annotations

import json
import re
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

_DECODER = json.JSONDecoder()
_WS = whitespace_run(r"\s*")


class SectionToolFormat(ToolFormat):
    """A section of calls; subclasses give the markers and read one call's body."""

    section_open: ClassVar[str]
    section_close: ClassVar[str]
    call_open: ClassVar[str]
    call_close: ClassVar[str]
    special_markers: ClassVar[bool] = True

    def split(
        self, text: str, final: bool, id_seed: str, tools: Sequence[Mapping[str, Any]] | None
    ) -> tuple[str, tuple[ToolCall, ...]]:
        start = text.find(self.section_open)
        if start < 0:
            if final:
                return text, ()
            return text[: len(text) - held_suffix(text, (self.section_open,))], ()
        calls: list[ToolCall] = []
        pos = start + len(self.section_open)
        while True:
            at = _WS.match(text, pos).end()
            if not text.startswith(self.call_open, at):
                break
            end = text.find(self.call_close, at)
            parsed = None if end < 0 else self.parse_call(text[at + len(self.call_open) : end])
            if parsed is None:
                break
            name, arguments, given_id = parsed
            calls.append(ToolCall(given_id or tool_call_id(id_seed, len(calls)), name, arguments))
            pos = end + len(self.call_close)
        content = text[:start]
        if final:
            rest = text[pos:]
            if not calls:
                content = text  # nothing read as a call: the reply stays as generated
            elif rest.strip() not in ("", self.section_close):
                content += rest
        return content, tuple(calls)

    def plain_prefix(self, text: str, scan: int) -> tuple[str, int] | None:
        if text.find(self.section_open, scan) >= 0:
            return None
        return (
            text[: len(text) - held_suffix(text, (self.section_open,))],
            max(0, len(text) - len(self.section_open) + 1),
        )

    def parse_call(self, body: str) -> tuple[str, str, str | None] | None:
        """(name, arguments JSON text, the model's call id or None) of one call's body,
        None when malformed."""
        raise NotImplementedError

    def open_call(
        self, text: str, done: int, tools: Sequence[Mapping[str, Any]] | None
    ) -> OpenCall | None:
        section = text.find(self.section_open)
        start = text.rfind(self.call_open)
        if section < 0 or start < section or text.find(self.call_close, start) >= 0:
            return None
        body = start + len(self.call_open)
        head = self.call_head(text, body)
        if head is None:
            return None
        name, given_id, args = head
        args = _WS.match(text, args).end()
        if not text.startswith("{", args):
            return None
        return OpenCall(done, given_id, name, args)

    def call_head(self, text: str, body: int) -> tuple[str, str | None, int] | None:
        """(name, the model's call id or None, where the arguments start) of the call
        whose body starts at `body`, once its head is complete; None before."""
        return None


def _json_object(text: str) -> str | None:
    """`text` when it is exactly one JSON object (surrounding whitespace allowed)."""
    stripped = text.strip()
    try:
        value, end = _DECODER.raw_decode(stripped)
    except ValueError:
        return None
    return stripped if isinstance(value, dict) and end == len(stripped) else None


class DeepSeekV3ToolFormat(SectionToolFormat):
    name: ClassVar[str] = "deepseek_v3"
    section_open: ClassVar[str] = "<｜tool▁calls▁begin｜>"
    section_close: ClassVar[str] = "<｜tool▁calls▁end｜>"
    call_open: ClassVar[str] = "<｜tool▁call▁begin｜>"
    call_close: ClassVar[str] = "<｜tool▁call▁end｜>"
    markers: ClassVar[tuple[str, ...]] = ("<｜tool▁calls▁begin｜>",)
    sep: ClassVar[str] = "<｜tool▁sep｜>"

    def call_head(self, text: str, body: int) -> tuple[str, str | None, int] | None:
        sep = text.find(self.sep, body)
        fence = -1 if sep < 0 else text.find("\n```json\n", sep)
        name = "" if fence < 0 else text[sep + len(self.sep) : fence].strip()
        return (name, None, fence + len("\n```json\n")) if name else None

    def parse_call(self, body: str) -> tuple[str, str, str | None] | None:
        kind, sep, rest = body.partition(self.sep)
        head, fence, args = rest.partition("\n```json\n")
        if not sep or not fence or not args.endswith("\n```") or not head.strip():
            return None
        arguments = _json_object(args.removesuffix("\n```"))
        return None if arguments is None else (head.strip(), arguments, None)


class DeepSeekV31ToolFormat(DeepSeekV3ToolFormat):
    name: ClassVar[str] = "deepseek_v31"

    def call_head(self, text: str, body: int) -> tuple[str, str | None, int] | None:
        sep = text.find(self.sep, body)
        name = "" if sep < 0 else text[body:sep].strip()
        return (name, None, sep + len(self.sep)) if name else None

    def parse_call(self, body: str) -> tuple[str, str, str | None] | None:
        name, sep, args = body.partition(self.sep)
        arguments = _json_object(args) if sep and name.strip() else None
        return None if arguments is None else (name.strip(), arguments, None)


_KIMI_ID = re.compile(r"\s*(functions\.([^\s:<]+):\d+)\s*")


class KimiK2ToolFormat(SectionToolFormat):
    name: ClassVar[str] = "kimi_k2"
    section_open: ClassVar[str] = "<|tool_calls_section_begin|>"
    section_close: ClassVar[str] = "<|tool_calls_section_end|>"
    call_open: ClassVar[str] = "<|tool_call_begin|>"
    call_close: ClassVar[str] = "<|tool_call_end|>"
    markers: ClassVar[tuple[str, ...]] = ("<|tool_calls_section_begin|>",)
    arg_open: ClassVar[str] = "<|tool_call_argument_begin|>"

    def call_head(self, text: str, body: int) -> tuple[str, str | None, int] | None:
        sep = text.find(self.arg_open, body)
        match = None if sep < 0 else _KIMI_ID.fullmatch(text, body, sep)
        if match is None:
            return None
        return match.group(2), match.group(1), sep + len(self.arg_open)

    def parse_call(self, body: str) -> tuple[str, str, str | None] | None:
        head, sep, args = body.partition(self.arg_open)
        match = _KIMI_ID.fullmatch(head)
        arguments = _json_object(args) if sep and match else None
        if match is None or arguments is None:
            return None
        return match.group(2), arguments, match.group(1)
