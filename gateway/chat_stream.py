"""Streamed chat replies: a choice's growing output -> deltas and `chat.completion.chunk`
bodies that add up to exactly the reply `translate.parse_choice` gives for the final
output (the last delta carries that very reply, made by `translate.finish_choice`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from areal_service.sglang_protocol import FinishReason
from gateway.tokenizer import ChatTokenizer
from gateway.toolparse import ParsedText, ToolCall, held_suffix, parse_output
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


class IncrementalDecoder:
    """Decodes a growing id list into stable text: never emits half a UTF-8 character
    (a trailing U+FFFD is held until the next token completes it). O(window) per token:
    only the ids since the last stable point are decoded (vLLM's prefix/read offsets)."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""

    def push(self, ids: Sequence[int]) -> None:
        self._ids.extend(ids)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        new_text = self._tok.decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)

    def flush(self) -> None:
        """At the end: emit what is left, incomplete characters included."""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        self.text += self._tok.decode(self._ids[self._prefix:])[len(prefix_text):]
        self._prefix = self._read = len(self._ids)


def _hold_stop(text: str, stops: Sequence[str]) -> str:
    """Text safe to show before the end: cut at a stop string, and hold a tail that may
    still become one."""
    if not stops:
        return text
    cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    if cuts:
        return text[:min(cuts)]
    return text[: len(text) - held_suffix(text, stops)]


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
    `parse_choice` returns for the final output. Feed it cumulative outputs (`update`,
    SGLang's default stream) or new tokens only (`push`, e.g. the backend client's
    deltas across abort/resubmit rounds). Re-parses the stable text each step: O(text)
    C-level string scans, ~20 us per token all told for a 2k-token reply."""

    def __init__(self, tokenizer: ChatTokenizer, *, completion_id: str, index: int = 0,
                 parse_tools: bool, stop: Sequence[str] = (), logprobs: int | None = None
                 ) -> None:
        self._tok = tokenizer
        self._decoder = IncrementalDecoder(tokenizer)
        self._seed = id_seed(completion_id, index)
        self.index = index
        self._parse_tools = parse_tools
        self._stop = tuple(stop)
        self._logprobs = logprobs
        self._ids: list[int] = []
        self._lps: list[float] = []
        self._tops: list[tuple[tuple[int, float], ...]] = []
        self._pushed = 0
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
        self._tops.extend(new_top)
        final = finish is not None
        end = visible_len(self._ids, finish)
        so_far = GeneratedChoice(tuple(self._ids), tuple(self._lps), finish,
                                 tuple(self._tops), cached_tokens) if final else None
        lps = () if self._logprobs is None else self._logprob_slice(self._pushed, end)
        self._decoder.push(self._ids[self._pushed:end])
        self._pushed = end
        if final:
            self._decoder.flush()
            text = trim_stop(self._decoder.text, finish)
        else:
            text = _hold_stop(self._decoder.text, self._stop)
        parsed = parse_output(text, parse_tools=self._parse_tools, id_seed=self._seed,
                              final=final)
        reasoning = _advance(parsed.reasoning or "", self._sent.reasoning or "")
        content = _advance(parsed.content, self._sent.content)
        calls = parsed.tool_calls[len(self._sent.tool_calls):]
        self._sent = parsed
        if so_far is not None:
            all_lps = None if self._logprobs is None else self._logprob_slice(0, end)
            self.result = finish_choice(self._tok, so_far, parsed, text, index=self.index,
                                         logprobs=all_lps)
        return StreamDelta(reasoning, content, calls, lps, self.result)

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
                 logprobs: int | None = None) -> None:
        self._stream = ChoiceStream(tokenizer, completion_id=completion_id, index=index,
                                    parse_tools=parse_tools, stop=stop, logprobs=logprobs)
        self._head = {"id": completion_id, "object": "chat.completion.chunk",
                      "created": created, "model": model}
        self._index = index
        self._started = False
        self._calls = 0

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
