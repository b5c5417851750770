"""The chat wire's encode out: a finished reply -> the `chat.completion` body; a
choice's deltas (`ChoiceStream`) -> `chat.completion.chunk` bodies that add up to that
very reply. Chat chunks carry no blocks: each delta is sent as it comes, a tool call's
fragments keyed by the call's index.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from areal_service.sglang_protocol import FinishReason
from gateway.tokenizer import ChatTokenizer
from gateway.translate import GeneratedChoice, ParsedChoice, Usage
from gateway.wires.choice_stream import ChoiceStream, StreamDelta

dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
"""Compact JSON of a chunk (the encoder `gateway.pipeline.dumps` is: the same bytes)."""
_escape = json.encoder.encode_basestring
"""A str as a JSON string literal, non-ASCII kept: what `dumps` does to a string (C)."""


def build_chat_completion(
    *, completion_id: str, model: str, created: int, choices: Sequence[ParsedChoice], usage: Usage
) -> dict[str, Any]:
    """`chat.completion` body (any number of choices; `model` echoes the request)."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [c.to_openai() for c in choices],
        "usage": usage.to_chat(),
    }


class ChatStreamAssembler:
    """`chat.completion.chunk` dicts for one choice, from its growing output.

    Order: a role chunk (`{"role": "assistant", "content": ""}`), then reasoning_content /
    content / tool-call deltas (a call's first fragment carries index, id, type and name;
    its arguments follow as they are generated, or whole when the call closes for
    formats that do not stream them: `ChoiceStream`), logprobs with the step that added
    the tokens, and a last chunk with an empty delta and `finish_reason`. After an abort
    and resubmission keep feeding the same stream (`push` the new tokens), so the client
    sees one uninterrupted reply; only the final finish reason may be passed in.
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        completion_id: str,
        model: str,
        created: int,
        index: int = 0,
        parse_tools: bool,
        stop: Sequence[str] = (),
        logprobs: int | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self._stream = ChoiceStream(
            tokenizer,
            completion_id=completion_id,
            index=index,
            parse_tools=parse_tools,
            stop=stop,
            logprobs=logprobs,
            tools=tools,
            call_fragments=True,
        )
        self._head = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }
        self._index = index
        self._started = False
        # A content-only chunk as text: the pre-encoded JSON around the escaped delta
        # (`dumps` of the same dict gives the same bytes; a test holds them equal).
        whole = dumps(self._chunk({"content": ""}))
        at = whole.rindex('"content":""') + len('"content":')
        self._content_head = "data: " + whole[:at]
        self._content_tail = whole[at + 2 :] + "\n\n"
        self._frame: tuple[int, str, str] | None = None
        """(call index, SSE text before and after an argument fragment of that call)."""

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

    def push(
        self,
        new_ids: Sequence[int],
        new_logprobs: Sequence[float],
        finish: FinishReason | None,
        *,
        new_top: Sequence[tuple[tuple[int, float], ...]] = (),
    ) -> list[dict[str, Any]]:
        """Chunks for new tokens only (backend deltas); `finish` set on the last push."""
        return self._chunks(self._stream.push(new_ids, new_logprobs, finish, new_top=new_top))

    def push_sse(
        self,
        new_ids: Sequence[int],
        new_logprobs: Sequence[float],
        finish: FinishReason | None,
        *,
        new_top: Sequence[tuple[tuple[int, float], ...]] = (),
    ) -> str:
        """`push`, as SSE text (`data: {chunk}\n\n` per chunk; "" when nothing is new).
        A content-only delta, the common step, is the pre-encoded chunk around the
        escaped text: one C string escape instead of a dict and a JSON encode."""
        delta = self._stream.push(new_ids, new_logprobs, finish, new_top=new_top)
        if self._started and not delta.reasoning and not delta.logprobs and delta.finished is None:
            if not delta.call_fragments:
                if not delta.content:
                    return ""
                return self._content_head + _escape(delta.content) + self._content_tail
            if not delta.content and len(delta.call_fragments) == 1:
                frag = delta.call_fragments[0]
                if frag.head is None:  # a streamed call's next argument text
                    head, tail = self._arguments_frame(frag.index)
                    return head + _escape(frag.arguments) + tail
        return "".join(f"data: {dumps(chunk)}\n\n" for chunk in self._chunks(delta))

    def _arguments_frame(self, index: int) -> tuple[str, str]:
        """The SSE text around an argument fragment of call `index` (pre-encoded once per
        call, as the content chunk is)."""
        if self._frame is None or self._frame[0] != index:
            whole = dumps(
                self._chunk({"tool_calls": [{"index": index, "function": {"arguments": ""}}]})
            )
            at = whole.rindex('"arguments":""') + len('"arguments":')
            self._frame = (index, "data: " + whole[:at], whole[at + 2 :] + "\n\n")
        return self._frame[1], self._frame[2]

    def _chunks(self, delta: StreamDelta) -> list[dict[str, Any]]:
        chunks = [] if self._started else [self.start()]
        if delta.reasoning:
            chunks.append(self._chunk({"reasoning_content": delta.reasoning}))
        if delta.content:
            chunks.append(self._chunk({"content": delta.content}))
        for frag in delta.call_fragments:
            if frag.head is not None:
                chunks.append(
                    self._chunk(
                        {
                            "tool_calls": [
                                {
                                    "index": frag.index,
                                    "id": frag.head.id,
                                    "type": "function",
                                    "function": {"name": frag.head.name, "arguments": ""},
                                }
                            ]
                        }
                    )
                )
            else:
                chunks.append(
                    self._chunk(
                        {
                            "tool_calls": [
                                {"index": frag.index, "function": {"arguments": frag.arguments}}
                            ]
                        }
                    )
                )
        if delta.logprobs:
            if not chunks:
                chunks.append(self._chunk({}))
            chunks[-1]["choices"][0]["logprobs"] = {
                "content": [t.to_openai() for t in delta.logprobs],
                "refusal": None,
            }
        if delta.finished is not None:
            chunks.append(self._chunk({}, finish_reason=delta.finished.finish_reason))
        return chunks

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {
            **self._head,
            "choices": [
                {
                    "index": self._index,
                    "delta": delta,
                    "finish_reason": finish_reason,
                    "logprobs": None,
                }
            ],
        }


def build_usage_chunk(
    *, completion_id: str, model: str, created: int, usage: Usage
) -> dict[str, Any]:
    """The `include_usage` chunk (`choices: []`), sent after the last choice chunk and
    before `[DONE]`."""
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage.to_chat(),
    }
