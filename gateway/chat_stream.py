"""Streamed chat replies: a choice's growing output -> deltas and `chat.completion.chunk`
bodies that add up to exactly the reply `translate.parse_choice` gives for the final
output (the last delta carries that very reply, made by `translate.finish_choice`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from areal_service.sglang_protocol import FinishReason
from gateway.tokenizer import ChatTokenizer
from gateway.toolparse import ParsedText, ToolCall, held_suffix
from gateway.translate import (
    GeneratedChoice,
    ParsedChoice,
    TokenLogprob,
    Usage,
    finish_choice,
    id_seed,
    token_logprobs,
    trim_stop,
    visible_len,
)

dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
"""Compact JSON of a chunk (the encoder `gateway.pipeline.dumps` is: the same bytes)."""
_escape = json.encoder.encode_basestring
"""A str as a JSON string literal, non-ASCII kept: what `dumps` does to a string (C)."""


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """What one stream update adds; `finished` is set on the last one."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finished: ParsedChoice | None = None


class ChoiceStream:
    """Turns one choice's growing output into deltas that add up to exactly what
    `parse_choice` returns for the final output. Feed it cumulative outputs (`update`)
    or new tokens only (`push`, e.g. the backend client's deltas across abort/resubmit
    rounds).

    Cost per token, O(new text): the Rust decode stream gives the new text; stop strings
    are searched only where a new one could start; plain content (no reasoning block, no
    tool call so far: the model's parser's `plain_prefix`) is advanced without re-parsing.
    Text with a reasoning block or a tool call is re-parsed whole each step (the parser,
    chosen once per model: C-level scans). The final step decodes the whole output once
    and parses it as `parse_choice` does, so the recorded reply is the non-streamed one."""

    def __init__(self, tokenizer: ChatTokenizer, *, completion_id: str, index: int = 0,
                 parse_tools: bool, stop: Sequence[str] = (), logprobs: int | None = None,
                 tools: Sequence[Mapping[str, Any]] | None = None) -> None:
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

    def update(self, choice: GeneratedChoice) -> StreamDelta:
        """Next cumulative output (ids so far, finish set on the last one)."""
        n = len(self._ids)
        return self.push(choice.output_ids[n:], choice.output_logprobs[n:], choice.finish,
                         new_top=choice.top_logprobs[n:], cached_tokens=choice.cached_tokens)

    def push(self, new_ids: Sequence[int], new_logprobs: Sequence[float],
             finish: FinishReason | None, *,
             new_top: Sequence[tuple[tuple[int, float], ...]] = (), cached_tokens: int = 0
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
            self._text += self._decoder.push(self._ids[self._pushed:end])
        self._pushed = end
        if final:
            # One whole decode at the end: the reply is exactly the non-streamed one.
            text = trim_stop(self._tok.decode(self._ids[:end]), finish)
            parsed = self._parser.parse(text, parse_tools=self._parse_tools,
                                        id_seed=self._seed, final=True, tools=self._tools)
        else:
            parsed = self._partial(self._shown())
        reasoning = (_advance(parsed.reasoning or "", self._sent.reasoning or "")
                     if parsed.reasoning is not None or self._sent.reasoning else "")
        content = _advance(parsed.content, self._sent.content)
        calls = parsed.tool_calls[len(self._sent.tool_calls):]
        self._sent = parsed
        if final:
            assert finish is not None
            so_far = GeneratedChoice(tuple(self._ids), tuple(self._lps), finish,
                                     tuple(self._tops), cached_tokens)
            all_lps = None if self._logprobs is None else self._logprob_slice(0, end)
            self.result = finish_choice(self._tok, so_far, parsed, text, index=self.index,
                                         logprobs=all_lps)
        return StreamDelta(reasoning, content, calls, lps, self.result)

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
        return text[:self._cut]

    def _partial(self, text: str) -> ParsedText:
        """The parser's `parse(text, final=False)`, without re-parsing plain content."""
        if not self._plain:
            if self._parser.reasoning.pending(text):
                return self._parser.parse(text, parse_tools=self._parse_tools,
                                          id_seed=self._seed, final=False, tools=self._tools)
            self._plain = True  # text only grows: no leading reasoning block from here on
        if not self._parse_tools:
            return ParsedText(text, None, ())
        if self._tool_scan >= 0:
            plain = self._plain_prefix(text, self._tool_scan)
            if plain is not None:
                self._tool_scan = plain[1]
                return ParsedText(plain[0], None, ())
        self._tool_scan = -1  # a tool call may have started: parsed whole from now on
        return self._parser.parse(text, parse_tools=True, id_seed=self._seed, final=False,
                                  tools=self._tools)

    def _logprob_slice(self, start: int, end: int) -> tuple[TokenLogprob, ...]:
        assert self._logprobs is not None
        view = GeneratedChoice(tuple(self._ids[start:end]), tuple(self._lps[start:end]),
                               None, tuple(self._tops[start:end]))
        return token_logprobs(self._tok, view, 0, end - start, self._logprobs)


def _advance(now: str, sent: str) -> str:
    if not now.startswith(sent):  # the parser's holdback rules guarantee this
        raise RuntimeError(f"stream text went backwards: {sent!r} -> {now!r}")
    return now[len(sent):]


class ChatStreamAssembler:
    """`chat.completion.chunk` dicts for one choice, from its growing output.

    Order: a role chunk (`{"role": "assistant", "content": ""}`), then reasoning_content /
    content / tool-call deltas (a call's first fragment carries index, id, type and name;
    its arguments follow once `</tool_call>` closes), logprobs with the step that added
    the tokens, and a last chunk with an empty delta and `finish_reason`. After an abort
    and resubmission keep feeding the same stream (`push` the new tokens), so the client
    sees one uninterrupted reply; only the final finish reason may be passed in.
    """

    def __init__(self, tokenizer: ChatTokenizer, *, completion_id: str, model: str,
                 created: int, index: int = 0, parse_tools: bool, stop: Sequence[str] = (),
                 logprobs: int | None = None, tools: Sequence[Mapping[str, Any]] | None = None
                 ) -> None:
        self._stream = ChoiceStream(tokenizer, completion_id=completion_id, index=index,
                                    parse_tools=parse_tools, stop=stop, logprobs=logprobs,
                                    tools=tools)
        self._head = {"id": completion_id, "object": "chat.completion.chunk",
                      "created": created, "model": model}
        self._index = index
        self._started = False
        self._calls = 0
        # A content-only chunk as text: the pre-encoded JSON around the escaped delta
        # (`dumps` of the same dict gives the same bytes; a test holds them equal).
        whole = dumps(self._chunk({"content": ""}))
        at = whole.rindex('"content":""') + len('"content":')
        self._content_head = "data: " + whole[:at]
        self._content_tail = whole[at + 2:] + "\n\n"

    @property
    def result(self) -> ParsedChoice | None:
        """The finished choice (for the store and usage), once the stream ended."""
        return self._stream.result

    def start(self) -> dict[str, Any]:
        """The role chunk; sent before the first token arrives if the route wants."""
        self._started = True
        return self._chunk({"role": "assistant", "content": ""})

    def update(self, choice: GeneratedChoice) -> list[dict[str, Any]]:
        """Chunks for the next cumulative output."""
        return self._chunks(self._stream.update(choice))

    def push(self, new_ids: Sequence[int], new_logprobs: Sequence[float],
             finish: FinishReason | None, *,
             new_top: Sequence[tuple[tuple[int, float], ...]] = ()) -> list[dict[str, Any]]:
        """Chunks for new tokens only (backend deltas); `finish` set on the last push."""
        return self._chunks(self._stream.push(new_ids, new_logprobs, finish, new_top=new_top))

    def push_sse(self, new_ids: Sequence[int], new_logprobs: Sequence[float],
                 finish: FinishReason | None, *,
                 new_top: Sequence[tuple[tuple[int, float], ...]] = ()) -> str:
        """`push`, as SSE text (`data: {chunk}\n\n` per chunk; "" when nothing is new).
        A content-only delta, the common step, is the pre-encoded chunk around the
        escaped text: one C string escape instead of a dict and a JSON encode."""
        delta = self._stream.push(new_ids, new_logprobs, finish, new_top=new_top)
        if (self._started and not delta.reasoning and not delta.tool_calls
                and not delta.logprobs and delta.finished is None):
            if not delta.content:
                return ""
            return self._content_head + _escape(delta.content) + self._content_tail
        return "".join(f"data: {dumps(chunk)}\n\n" for chunk in self._chunks(delta))

    def _chunks(self, delta: StreamDelta) -> list[dict[str, Any]]:
        chunks = [] if self._started else [self.start()]
        if delta.reasoning:
            chunks.append(self._chunk({"reasoning_content": delta.reasoning}))
        if delta.content:
            chunks.append(self._chunk({"content": delta.content}))
        for call in delta.tool_calls:
            chunks.append(self._chunk({"tool_calls": [{
                "index": self._calls, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": ""}}]}))
            chunks.append(self._chunk({"tool_calls": [{
                "index": self._calls, "function": {"arguments": call.arguments}}]}))
            self._calls += 1
        if delta.logprobs:
            if not chunks:
                chunks.append(self._chunk({}))
            chunks[-1]["choices"][0]["logprobs"] = {
                "content": [t.to_openai() for t in delta.logprobs], "refusal": None}
        if delta.finished is not None:
            chunks.append(self._chunk({}, finish_reason=delta.finished.finish_reason))
        return chunks

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None
               ) -> dict[str, Any]:
        return {**self._head, "choices": [{"index": self._index, "delta": delta,
                                           "finish_reason": finish_reason, "logprobs": None}]}


def build_usage_chunk(*, completion_id: str, model: str, created: int, usage: Usage
                      ) -> dict[str, Any]:
    """The `include_usage` chunk (`choices: []`), sent after the last choice chunk and
    before `[DONE]`."""
    return {"id": completion_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [], "usage": usage.to_chat()}
