"""The shapes every output parser shares: a parsed reply (`ParsedText`, `ToolCall`), the
deterministic tool-call id, the streaming hold-back rule (`held_suffix`), and
`OutputParser`, one model family's reasoning format plus tool-call format. Pure strings:
no tokens, no HTTP.

Streaming contract (every format keeps it): parsing a prefix of a generation with
`final=False` holds back whatever a continuation could still change, so each partial
result's content and reasoning are prefixes of the final ones and its tool calls a prefix
of the final list. `gateway/wires/choice_stream.py` sends the differences as deltas.

Formats whose arguments are the model's own JSON text also say where the call being
generated stands (`ToolFormat.open_call`): its name once known, and where its arguments
start, so a stream can send the arguments as they arrive (`JsonEnd` finds where they
end, reading only new text). The final arguments start with what was sent, unless the
call turns out malformed or cut off (then the reply keeps it as text, as a whole parse
does; the stream has shown a partial call, as vLLM's do).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, cast


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the model made; `arguments` is JSON object text (the model's own
    text where the format writes JSON, else the parser's rendering of the values)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """Chat Completions wire form (`message.tool_calls[i]`)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ParsedText:
    """The parts of one generated text. `content` is "" when there is none."""

    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class OpenCall:
    """The call being generated at the end of a partial reply: its position among the
    reply's calls, its id when the model writes one (else `tool_call_id(seed, index)`),
    its name, and the offset its arguments' JSON object starts at."""

    index: int
    id: str | None
    name: str
    args_start: int
    arguments: str | None = None
    """For formats that build the arguments from typed values (not the model's JSON
    text; `args_start` then unused): the call's arguments so far, a prefix of its final
    ones (the values read so far, without the closing brace)."""


_JSON_MARK = re.compile(r'[{}\[\]"]')
_STRING_MARK = re.compile(r'["\\]')


class JsonEnd:
    """Where the JSON object starting at `start` of a growing text ends, read
    incrementally: each `feed` scans only the text added since the last one (string
    contents skipped by a C-level regex search), so streaming a call's arguments costs
    O(new text) per step."""

    __slots__ = ("depth", "end", "in_string", "pos")

    def __init__(self, start: int) -> None:
        self.pos = start
        """Text before this offset is read (all of it belongs to the object)."""
        self.depth = 0
        self.in_string = False
        self.end: int | None = None
        """The offset just past the object, once read."""

    def feed(self, text: str) -> int:
        """Reads `text` (the same text, grown) on; returns the offset read to."""
        if self.end is not None:
            return self.end
        pos, depth, in_string = self.pos, self.depth, self.in_string
        while True:
            if in_string:
                mark = _STRING_MARK.search(text, pos)
                if mark is None:
                    pos = len(text)
                    break
                if mark.group() == "\\":
                    if mark.end() >= len(text):
                        pos = mark.start()  # the escaped character is not here yet
                        break
                    pos = mark.end() + 1
                    continue
                in_string, pos = False, mark.end()
                continue
            mark = _JSON_MARK.search(text, pos)
            if mark is None:
                pos = len(text)
                break
            char, pos = mark.group(), mark.end()
            if char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            else:
                depth -= 1
                if depth <= 0:
                    self.end = pos
                    break
        self.pos, self.depth, self.in_string = pos, depth, in_string
        return pos


def tool_call_id(seed: str, index: int) -> str:
    """`call_<24 hex>`, deterministic for (completion/choice seed, call index), so a
    streamed and a non-streamed rendering of the same output agree."""
    return "call_" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]


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


class WhitespaceRun(Protocol):
    """A compiled pattern that matches the empty string, so `match` never returns None."""

    def match(self, string: str, pos: int = 0, /) -> re.Match[str]: ...


def whitespace_run(pattern: str) -> WhitespaceRun:
    """`re.compile(pattern)` for a pattern like `\\s*`, typed so `.match(s, pos).end()`
    needs no None check (once, at import: the compiled pattern itself is returned)."""
    return cast(WhitespaceRun, re.compile(pattern))


def is_proper_prefix(text: str, marker: str) -> bool:
    """`text` is shorter than `marker` and starts it (the marker may still be coming)."""
    return len(text) < len(marker) and marker.startswith(text)


class ReasoningFormat:
    """No reasoning: every character is content. Subclasses split a reasoning part off."""

    name: ClassVar[str] = "none"
    open: ClassVar[str | None] = None
    """The marker a reasoning block starts with (None: the format has none)."""
    close: ClassVar[str | None] = None
    """The marker that ends reasoning (its token counts the reasoning tokens)."""

    def split(self, text: str, final: bool) -> tuple[str | None, str] | None:
        """(reasoning or None, the text after it); None while `text` may still become
        the start of a reasoning block (nothing can be shown yet)."""
        return None, text

    def pending(self, text: str) -> bool:
        """Whether `text` (a prefix of the reply) has, or may still get, reasoning at its
        start: the stream parses it whole; False: the rest of the reply is content."""
        return False


class ToolFormat:
    """No tool calls: the text after reasoning is content. Subclasses parse calls."""

    name: ClassVar[str] = "none"
    markers: ClassVar[tuple[str, ...]] = ()
    """Held back at the end of partial plain content: a tool call may start with one."""
    special_markers: ClassVar[bool] = False
    """The format's markers are special tokens (Mistral's `[TOOL_CALLS]`): replies are
    decoded keeping special tokens, as vLLM does for these parsers (the stop token that
    ends a reply is cut off before decoding either way)."""
    arguments_as_mapping: ClassVar[bool] = False
    """The family's chat template reads a replayed call's `arguments` as a mapping
    (`arguments|items`, `arguments|tojson`), not as the JSON string the API carries."""

    def split(
        self, text: str, final: bool, id_seed: str, tools: Sequence[Mapping[str, Any]] | None
    ) -> tuple[str, tuple[ToolCall, ...]]:
        """(content, tool calls) of the text after reasoning; `tools`: the request's tool
        definitions, for formats whose argument values take their types from a schema."""
        return text, ()

    def plain_prefix(self, text: str, scan: int) -> tuple[str, int] | None:
        """While no call can have started in `text`: (content safe to show now, the
        offset the next call may start searching from); None once one may have (the
        caller then parses whole). `scan`: the offset returned last time (0 at first).
        The stream's per-token fast path: O(new text)."""
        return text, len(text)

    value_ends: ClassVar[tuple[str, ...]] = ()
    """Formats that build the arguments (`OpenCall.arguments`): the markers after which
    an open call's arguments may grow or the call close; a stream re-parses only when
    one arrives."""

    def open_call(
        self, text: str, done: int, tools: Sequence[Mapping[str, Any]] | None
    ) -> OpenCall | None:
        """The call being generated at the end of `text` (a partial reply after
        reasoning, whose partial parse completed `done` calls; `tools`: the request's
        definitions, as for `split`), once its name is known
        and its arguments (the model's JSON object text, which the final parse returns
        verbatim) have started; None otherwise, and for formats whose calls stream
        whole. Called only between calls' arguments: O(len(text))."""
        return None

    def content_only(self, text: str, final: bool) -> str:
        """The content of the text after reasoning when no tools were offered: the text
        itself, unless the format wraps content in markup of its own (harmony)."""
        return text

    def template_arguments(self, arguments: str) -> Any:
        """A replayed call's `arguments` as this family's chat template renders back the
        text the model wrote: the JSON string itself, unless `arguments_as_mapping` (then
        the object it encodes; a string that is not one stays as is)."""
        if not self.arguments_as_mapping:
            return arguments
        args = json_object_or_none(arguments)
        return arguments if args is None else args


class OutputParser:
    """One model family's output format: a reasoning format and a tool-call format,
    chosen once per served model (`gateway.toolparse.registry`)."""

    def __init__(self, reasoning: ReasoningFormat, tools: ToolFormat) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def name(self) -> str:
        return f"{self.tools.name}+{self.reasoning.name}"

    def parse_open(
        self, text: str, *, id_seed: str, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[ParsedText, OpenCall | None]:
        """`parse(text, parse_tools=True, final=False)` and the call being generated at its
        end (`ToolFormat.open_call`), its `args_start` an offset of `text`."""
        split = self.reasoning.split(text, False)
        if split is None:
            return ParsedText("", None, ()), None
        reasoning, rest = split
        content, calls = self.tools.split(rest, False, id_seed, tools)
        parsed = ParsedText(content, reasoning, calls)
        base = len(text) - len(rest)
        if not text.endswith(rest):
            return parsed, None  # the reasoning format rewrote the rest (harmony)
        found = self.tools.open_call(rest, len(calls), tools)
        if found is None:
            return parsed, None
        if found.arguments is not None:
            return parsed, found
        return parsed, OpenCall(found.index, found.id, found.name, base + found.args_start)

    def parse(
        self,
        text: str,
        *,
        parse_tools: bool,
        id_seed: str,
        final: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> ParsedText:
        """Split generated text into reasoning, content and tool calls (`final=False`:
        `text` is a prefix of the generation; see the module's streaming contract)."""
        split = self.reasoning.split(text, final)
        if split is None:
            return ParsedText("", None, ())
        reasoning, rest = split
        if not parse_tools:
            return ParsedText(self.tools.content_only(rest, final), reasoning, ())
        content, calls = self.tools.split(rest, final, id_seed, tools)
        return ParsedText(content, reasoning, calls)


def arguments_prefix(args: Mapping[str, Any]) -> str:
    """The JSON text of `args` without its closing brace: with `json.dumps` (as the final
    arguments are written) a prefix of the text of any dict extending `args`."""
    return json.dumps(args, ensure_ascii=False)[:-1]


def tool_properties(
    tools: Sequence[Mapping[str, Any]] | None, name: str
) -> Mapping[str, Any] | None:
    """The JSON-schema `properties` of the request's function `name` (None: unknown)."""
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and fn.get("name") == name:
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, Mapping) else None
            return props if isinstance(props, Mapping) else None
    return None


def json_object_or_none(text: str) -> dict[str, Any] | None:
    """`text` parsed as a JSON object, or None when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
