"""The Anthropic Messages wire's encode out: a finished choice -> a `message` with
`thinking` / `text` / `tool_use` blocks, or, streamed, the SSE events Anthropic clients
parse (`message_start`, `content_block_start|delta|stop`, `message_delta`,
`message_stop`, `ping`), named and shaped over the block stream (`gateway.wires.blocks`).
Errors on this wire take Anthropic's shape `{"type": "error", "error": {"type",
"message"}}` (`error_body`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from areal_service.sglang_protocol import FinishReason
from gateway.errors import OpenAIError
from gateway.signing import Signer
from gateway.tokenizer import ChatTokenizer
from gateway.toolparse import ToolCall
from gateway.toolparse.base import json_object_or_none
from gateway.translate import ParsedChoice, SamplingSpec, Usage
from gateway.wires.anthropic.translate import arguments_text, tool_input
from gateway.wires.blocks import REASONING, BlockStream, TextKind

# ---------------------------------------------------------------- choice -> message


def stop_reason(choice: ParsedChoice, matched: str | None = None) -> str:
    if choice.finish_reason == "tool_calls":
        return "tool_use"
    if choice.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if matched else "end_turn"


def anthropic_usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def thinking_block(text: str, signer: Signer) -> dict[str, Any]:
    """A thinking block; its `signature` is an HMAC of the text (clients send it back
    unchanged; the gateway renders the text, so it needs no secret inside)."""
    return {"type": "thinking", "thinking": text, "signature": signer.sign(text)}


def content_blocks(choice: ParsedChoice, signer: Signer) -> list[dict[str, Any]]:
    """[thinking?, text?, tool_use...] of a finished choice (text also when nothing else
    was generated)."""
    blocks: list[dict[str, Any]] = []
    if choice.reasoning_content:
        blocks.append(thinking_block(choice.reasoning_content, signer))
    if choice.content or not (choice.tool_calls or blocks):
        blocks.append({"type": "text", "text": choice.content or ""})
    blocks.extend(
        {"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)}
        for c in choice.tool_calls
    )
    return blocks


def build_message(
    *,
    message_id: str,
    model: str,
    choice: ParsedChoice,
    usage: Usage,
    signer: Signer,
    matched: str | None = None,
) -> dict[str, Any]:
    """The non-streamed reply (`type: "message"`)."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(choice, signer),
        "stop_reason": stop_reason(choice, matched),
        "stop_sequence": matched,
        "usage": anthropic_usage(usage),
    }


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(error: OpenAIError) -> dict[str, Any]:
    """Anthropic's error shape for `error` (its OpenAI `code` kept alongside)."""
    kind = _ERROR_TYPES.get(
        error.status, "api_error" if error.status >= 500 else "invalid_request_error"
    )
    body: dict[str, Any] = {"type": kind, "message": error.message}
    if error.code:
        body["code"] = error.code
    return {"type": "error", "error": body}


# ---------------------------------------------------------------- streaming


class MessageStreamAssembler(BlockStream):
    """Anthropic SSE events (dicts with `type`) for one generated choice.

    `start()`: message_start, ping. Then per step, the blocks of `gateway.wires.blocks`
    as content blocks: a thinking block (thinking_delta, and a signature_delta before it
    closes), a text block (text_delta), and a tool_use block per call, as Anthropic
    streams one: content_block_start with the id, name and `input: {}` as soon as the
    name is known, `input_json_delta` fragments as the arguments are generated,
    content_block_stop once the call closes. At the end, message_delta (stop_reason,
    usage); `stop()` is message_stop, sent once the record is durable. The message built
    from the events equals `build_message`'s, except where a call that started
    streaming turns out malformed or cut off: its block was shown (as a real server's
    would be), and the reply keeps its text."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        message_id: str,
        model: str,
        sampling: SamplingSpec,
        prompt_tokens: int,
        parse_tools: bool,
        signer: Signer,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__(
            tokenizer, message_id, parse_tools=parse_tools, stop=sampling.stop, tools=tools
        )
        self._id = message_id
        self._model = model
        self._prompt_tokens = prompt_tokens
        self._signer = signer
        self._thinking = ""
        self._events: list[dict[str, Any]] = []
        self._finish_reason: FinishReason | None = None
        self.message: dict[str, Any] | None = None
        """The final message (as `build_message` makes it), once finished."""

    def start(self) -> list[dict[str, Any]]:
        usage = {
            "input_tokens": self._prompt_tokens,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def push(self, new_ids: Sequence[int], finish: FinishReason | None) -> list[dict[str, Any]]:
        delta = self.stream.push(new_ids, [0.0] * len(new_ids), finish)
        events = self._events = []
        self._finish_reason = finish
        self.feed(delta)
        return events

    @staticmethod
    def stop() -> dict[str, Any]:
        return {"type": "message_stop"}

    # ------------------------------------------------------------ blocks as content blocks

    def on_open_text(self, kind: TextKind) -> None:
        block = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == REASONING
            else {"type": "text", "text": ""}
        )
        self._start(block)

    def on_text(self, kind: TextKind, text: str) -> None:
        if kind == REASONING:
            self._thinking += text
            self._delta({"type": "thinking_delta", "thinking": text})
        else:
            self._delta({"type": "text_delta", "text": text})

    def on_close_text(self, kind: TextKind) -> None:
        if kind == REASONING:
            self._delta({"type": "signature_delta", "signature": self._signer.sign(self._thinking)})
        self._events.append({"type": "content_block_stop", "index": self.opened - 1})

    def on_open_call(self, index: int, head: ToolCall) -> None:
        self._start({"type": "tool_use", "id": head.id, "name": head.name, "input": {}})

    def on_arguments(self, index: int, text: str, whole: ToolCall | None) -> None:
        if whole is not None and whole.arguments == text and json_object_or_none(text) is None:
            # A call that came whole with arguments that are no JSON object (a
            # JSON-encoded string): sent wrapped, as `tool_input` makes its input.
            text = arguments_text(tool_input(text))
        self._delta({"type": "input_json_delta", "partial_json": text})

    def on_close_call(self, index: int, completed: ToolCall | None, superseded: bool) -> None:
        self._events.append({"type": "content_block_stop", "index": self.opened - 1})

    def owes_text(self, choice: ParsedChoice) -> bool:
        return not self.opened  # nothing generated: one empty text block, as build_message

    def on_finish(self, choice: ParsedChoice) -> None:
        finish = self._finish_reason
        matched = finish.matched if finish is not None and isinstance(finish.matched, str) else None
        usage = Usage.of(self._prompt_tokens, [choice])
        self.message = build_message(
            message_id=self._id,
            model=self._model,
            choice=choice,
            usage=usage,
            signer=self._signer,
            matched=matched,
        )
        self._events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": self.message["stop_reason"], "stop_sequence": matched},
                "usage": {"output_tokens": usage.completion_tokens},
            }
        )

    def _start(self, block: dict[str, Any]) -> None:
        self._events.append(
            {"type": "content_block_start", "index": self.opened - 1, "content_block": block}
        )

    def _delta(self, delta: dict[str, Any]) -> None:
        self._events.append(
            {"type": "content_block_delta", "index": self.opened - 1, "delta": delta}
        )
