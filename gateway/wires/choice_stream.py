"""One choice's growing output -> the deltas every wire streams: reasoning text, reply
text, tool-call fragments (a call's head, then its argument text) and logprobs, adding up
to exactly the reply `translate.parse_choice` gives for the final output (the last delta
carries that very reply, made by `translate.finish_choice`). The chat wire encodes these
deltas as they come; the block wires read them through `gateway.wires.blocks`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from areal_service.sglang_protocol import FinishReason
from gateway.tokenizer import ChatTokenizer
from gateway.toolparse import ParsedText, ToolCall, held_suffix, tool_call_id
from gateway.toolparse.base import JsonEnd, OpenCall
from gateway.translate import (
    GeneratedChoice,
    ParsedChoice,
    TokenLogprob,
    finish_choice,
    id_seed,
    token_logprobs,
    trim_stop,
    visible_len,
)


@dataclass(frozen=True, slots=True)
class CallFragment:
    """Part of a tool call as the chat stream sends it: the call's first fragment has
    its `head` (id and name; its `arguments` field unused), the rest add `arguments`
    text. A call's fragments concatenate to its final arguments."""

    index: int
    arguments: str
    head: ToolCall | None = None


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """What one stream update adds; `finished` is set on the last one. `tool_calls`:
    the calls completed by this update; `call_fragments` (with `call_fragments=True`):
    the same calls as they are generated, name first, then argument text."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finished: ParsedChoice | None = None
    call_fragments: tuple[CallFragment, ...] = ()


@dataclass(slots=True)
class _StreamedCall:
    """A call whose head was sent: its arguments were sent up to `sent` of the text, or,
    for arguments the format builds, `built` was sent."""

    head: ToolCall
    args_start: int
    sent: int
    built: str | None = None

    def sent_arguments(self, text: str) -> str:
        return self.built if self.built is not None else text[self.args_start : self.sent]


class ChoiceStream:
    """Turns one choice's growing output into deltas that add up to exactly what
    `parse_choice` returns for the final output. Feed it cumulative outputs (`update`)
    or new tokens only (`push`, e.g. the backend client's deltas across abort/resubmit
    rounds).

    Cost per token, O(new text): the Rust decode stream gives the new text; stop strings
    are searched only where a new one could start; plain content (no reasoning block, no
    tool call so far: the model's parser's `plain_prefix`) is advanced without re-parsing.
    Text with a reasoning block or a tool call is re-parsed whole each step (the parser,
    chosen once per model: C-level scans), except, with `call_fragments`, while a call's
    arguments are being generated: then only the new text is read (`JsonEnd`). The final
    step decodes the whole output once and parses it as `parse_choice` does, so the
    recorded reply is the non-streamed one.

    `call_fragments` (the chat, Anthropic and Responses streams): a call's name is sent
    as soon as the format says it, then its arguments as they arrive, for formats whose
    arguments are the model's JSON text (`ToolFormat.open_call`) or built a value at a
    time; other formats' calls come whole when they close.
    A call that turns out malformed or cut off has streamed partially, and the reply's
    text (content) then holds it, as the whole reply does."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        completion_id: str,
        index: int = 0,
        parse_tools: bool,
        stop: Sequence[str] = (),
        logprobs: int | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        call_fragments: bool = False,
    ) -> None:
        self._tok = tokenizer
        self._parser = tokenizer.output_parser
        self._plain_prefix = self._parser.tools.plain_prefix  # bound once: runs per token
        self._tools = tools
        self._decoder = tokenizer.decode_stream()
        self._seed = id_seed(completion_id, index)
        self.index = index
        self._parse_tools = parse_tools
        self._stop = tuple(s for s in stop if s)
        self._stop_len = max(map(len, self._stop), default=0)
        self._logprobs = logprobs
        self._ids: list[int] = []
        self._lps: list[float] = []
        self._tops: list[tuple[tuple[int, float], ...]] = []
        self._pushed = 0
        self._text = ""
        """Decoded text of the ids pushed so far."""
        self._stop_scan = 0
        """No stop string starts before this offset of `_text`."""
        self._cut: int | None = None
        """Where a stop string starts in `_text` (nothing after it is shown)."""
        self._plain = self._parser.reasoning.open is None
        """The text is past any reasoning opening: reasoning stays None."""
        self._tool_scan = 0
        """No tool call starts before this offset of the shown text (while plain; -1:
        one may have started, the text is parsed whole)."""
        self._sent = ParsedText("", None, ())
        self.result: ParsedChoice | None = None
        self._fragments = call_fragments and parse_tools
        self._streamed: list[_StreamedCall] = []
        """Calls whose head was sent, by index."""
        self._args: JsonEnd | None = None
        """Reads the arguments of the last streamed call until that call completes."""
        self._found: OpenCall | None = None
        """The call being generated, as the last whole parse found it."""
        self._value_scan = -1
        """While that call's arguments are built from values: no value ends before this
        offset of the text (-1: not such a call)."""
        self._shown_text = ""
        """The text the streamed calls' offsets refer to (the last partial step's)."""

    def update(self, choice: GeneratedChoice) -> StreamDelta:
        """Next cumulative output (ids so far, finish set on the last one)."""
        n = len(self._ids)
        return self.push(
            choice.output_ids[n:],
            choice.output_logprobs[n:],
            choice.finish,
            new_top=choice.top_logprobs[n:],
            cached_tokens=choice.cached_tokens,
        )

    def push(
        self,
        new_ids: Sequence[int],
        new_logprobs: Sequence[float],
        finish: FinishReason | None,
        *,
        new_top: Sequence[tuple[tuple[int, float], ...]] = (),
        cached_tokens: int = 0,
    ) -> StreamDelta:
        """New tokens only (with their logprobs); `finish` set on the last push."""
        self._ids.extend(new_ids)
        self._lps.extend(new_logprobs)
        if new_top:
            self._tops.extend(new_top)
        final = finish is not None
        end = visible_len(self._ids, finish)
        lps = () if self._logprobs is None else self._logprob_slice(self._pushed, end)
        if end > self._pushed:
            self._text += self._decoder.push(self._ids[self._pushed : end])
        self._pushed = end
        if final:
            # One whole decode at the end: the reply is exactly the non-streamed one.
            text = trim_stop(self._tok.decode(self._ids[:end]), finish)
            parsed = self._parser.parse(
                text,
                parse_tools=self._parse_tools,
                id_seed=self._seed,
                final=True,
                tools=self._tools,
            )
        else:
            self._shown_text = self._shown()
            parsed = self._partial(self._shown_text)
        reasoning = (
            _advance(parsed.reasoning or "", self._sent.reasoning or "")
            if parsed.reasoning is not None or self._sent.reasoning
            else ""
        )
        content = _advance(parsed.content, self._sent.content)
        calls = parsed.tool_calls[len(self._sent.tool_calls) :]
        fragments = (
            self._call_fragments(parsed, final)
            if self._fragments
            and (parsed.tool_calls or self._found is not None or self._args is not None)
            else ()
        )
        self._sent = parsed
        if final:
            assert finish is not None
            so_far = GeneratedChoice(
                tuple(self._ids), tuple(self._lps), finish, tuple(self._tops), cached_tokens
            )
            all_lps = None if self._logprobs is None else self._logprob_slice(0, end)
            self.result = finish_choice(
                self._tok, so_far, parsed, text, index=self.index, logprobs=all_lps
            )
        return StreamDelta(reasoning, content, calls, lps, self.result, fragments)

    def _call_fragments(self, parsed: ParsedText, final: bool) -> tuple[CallFragment, ...]:
        """What of the calls is new since the last step: the rest of each call that
        completed (its head first if none was sent), then the head of a call that just
        opened, and the open call's new argument text."""
        out: list[CallFragment] = []
        text = self._shown_text
        for i in range(len(self._sent.tool_calls), len(parsed.tool_calls)):
            call = parsed.tool_calls[i]
            if i < len(self._streamed):
                done = self._streamed[i]
                sent = done.sent_arguments(text)
                # A call that reads differently once complete keeps what was sent (the
                # content holds its text if it is no call at all).
                if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                    out.append(CallFragment(i, call.arguments[len(sent) :]))
                if i == len(self._streamed) - 1:
                    self._args = None
                continue
            out.append(CallFragment(i, "", call))
            if call.arguments:
                out.append(CallFragment(i, call.arguments))
            self._streamed.append(_StreamedCall(call, 0, 0))
        found, self._found = self._found, None
        if final:
            return tuple(out)
        if found is not None and found.index == len(self._streamed):
            head = ToolCall(found.id or tool_call_id(self._seed, found.index), found.name, "")
            self._streamed.append(
                _StreamedCall(
                    head,
                    found.args_start,
                    found.args_start,
                    None if found.arguments is None else "",
                )
            )
            out.append(CallFragment(found.index, "", head))
            if found.arguments is None:
                self._args = JsonEnd(found.args_start)
                self._args.feed(text)
        if (
            found is not None
            and found.arguments is not None
            and found.index == len(self._streamed) - 1
        ):
            last = self._streamed[-1]
            built = last.built or ""
            if len(found.arguments) > len(built) and found.arguments.startswith(built):
                out.append(CallFragment(found.index, found.arguments[len(built) :]))
                last.built = found.arguments
        if self._args is not None:
            last = self._streamed[-1]
            if self._args.pos > last.sent:
                out.append(CallFragment(len(self._streamed) - 1, text[last.sent : self._args.pos]))
                last.sent = self._args.pos
        return tuple(out)

    def _parse_calls(self, text: str) -> ParsedText:
        """`parse(text, final=False)`; with `call_fragments`, notes the call being
        generated, and while its arguments are, reads only the new text (nothing but
        those arguments changes meanwhile)."""
        if not self._fragments:
            return self._parser.parse(
                text, parse_tools=True, id_seed=self._seed, final=False, tools=self._tools
            )
        args = self._args
        if args is not None and args.end is None:
            args.feed(text)
            if args.end is None:
                return self._sent
        ends = self._parser.tools.value_ends
        if self._value_scan >= 0:  # an open call with built arguments: a value must end
            if not any(text.find(end, self._value_scan) >= 0 for end in ends):
                self._value_scan = max(0, len(text) - max(map(len, ends)) + 1)
                return self._sent
        parsed, found = self._parser.parse_open(text, id_seed=self._seed, tools=self._tools)
        self._found = found
        self._value_scan = (
            max(0, len(text) - max(map(len, ends)) + 1)
            if found is not None and found.arguments is not None
            else -1
        )
        return parsed

    def _shown(self) -> str:
        """The text safe to show before the end: cut at a stop string, and a tail that
        may still become one held back. Searches only where a new match can start."""
        text = self._text
        if not self._stop:
            return text
        if self._cut is None:
            cuts = [i for i in (text.find(s, self._stop_scan) for s in self._stop) if i >= 0]
            if cuts:
                self._cut = min(cuts)
            else:
                self._stop_scan = max(0, len(text) - self._stop_len + 1)
                return text[: len(text) - held_suffix(text, self._stop)]
        return text[: self._cut]

    def _partial(self, text: str) -> ParsedText:
        """The parser's `parse(text, final=False)`, without re-parsing plain content."""
        if not self._plain:
            if self._parser.reasoning.pending(text):
                if self._parse_tools:
                    return self._parse_calls(text)
                return self._parser.parse(
                    text, parse_tools=False, id_seed=self._seed, final=False, tools=self._tools
                )
            self._plain = True  # text only grows: no leading reasoning block from here on
        if not self._parse_tools:
            return ParsedText(text, None, ())
        if self._tool_scan >= 0:
            plain = self._plain_prefix(text, self._tool_scan)
            if plain is not None:
                self._tool_scan = plain[1]
                return ParsedText(plain[0], None, ())
        self._tool_scan = -1  # a tool call may have started: parsed whole from now on
        return self._parse_calls(text)

    def _logprob_slice(self, start: int, end: int) -> tuple[TokenLogprob, ...]:
        assert self._logprobs is not None
        view = GeneratedChoice(
            tuple(self._ids[start:end]),
            tuple(self._lps[start:end]),
            None,
            tuple(self._tops[start:end]),
        )
        return token_logprobs(self._tok, view, 0, end - start, self._logprobs)


def _advance(now: str, sent: str) -> str:
    if not now.startswith(sent):  # the parser's holdback rules guarantee this
        raise RuntimeError(f"stream text went backwards: {sent!r} -> {now!r}")
    return now[len(sent) :]
