"""The Responses wire's encode out: a finished choice -> a `response` body (reasoning /
message / function_call items), or, streamed, the SSE events ending in
`response.completed`, named and shaped over the block stream (`gateway.wires.blocks`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from areal_service.sglang_protocol import FinishReason
from gateway.signing import Signer
from gateway.tokenizer import ChatTokenizer
from gateway.toolparse import ToolCall
from gateway.translate import GeneratedChoice, ParsedChoice, SamplingSpec, TokenLogprob, Usage
from gateway.wires.blocks import REASONING, BlockStream, TextKind
from gateway.wires.choice_stream import StreamDelta
from gateway.wires.responses.protocol import ResponsesRequest
from gateway.wires.responses.translate import ENCRYPTED_REASONING, ToolNames, tool_names

# ---------------------------------------------------------------- choice -> response


def _item_id(prefix: str, response_id: str, index: int = 0) -> str:
    """Deterministic item ids, so the streamed and the final response agree."""
    return (
        f"{prefix}_" + hashlib.sha256(f"{response_id}:{prefix}:{index}".encode()).hexdigest()[:24]
    )


def _reasoning_item(
    response_id: str, text: str, status: str, signer: Signer | None = None
) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    item = {
        "type": "reasoning",
        "id": _item_id("rs", response_id),
        "summary": [],
        "content": content,
        "status": status,
    }
    if signer is not None:
        item["encrypted_content"] = signer.seal(text)
    return item


def _message_item(
    response_id: str, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content = (
        []
        if text is None
        else [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]
    )
    return {
        "type": "message",
        "id": _item_id("msg", response_id),
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _function_call_item(
    response_id: str,
    index: int,
    call_id: str,
    name: str,
    arguments: str,
    status: str,
    names: ToolNames | None = None,
) -> dict[str, Any]:
    item = {
        "type": "function_call",
        "id": _item_id("fc", response_id, index),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
    if names and name in names:
        item["namespace"], item["name"] = names[name]
    return item


def _logprobs(choice: ParsedChoice) -> list[dict[str, Any]]:
    return [
        {
            "token": t.token,
            "logprob": t.logprob,
            "bytes": list(t.bytes),
            "top_logprobs": [{"token": tt, "logprob": lp, "bytes": list(b)} for tt, lp, b in t.top],
        }
        for t in choice.logprobs or ()
    ]


def _has_message(choice: ParsedChoice) -> bool:
    return bool(choice.content) or not choice.tool_calls


def output_items(
    response_id: str,
    choice: ParsedChoice,
    names: ToolNames | None = None,
    signer: Signer | None = None,
) -> list[dict[str, Any]]:
    """[reasoning?, message?, function_call...] for a finished choice; calls of
    namespaced tools (`names`) carry their `namespace`; reasoning its sealed text when a
    `signer` is given (`include: ["reasoning.encrypted_content"]`)."""
    items = []
    if choice.reasoning_content:
        items.append(_reasoning_item(response_id, choice.reasoning_content, "completed", signer))
    if _has_message(choice):
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        items.append(_message_item(response_id, choice.content or "", status, _logprobs(choice)))
    items.extend(
        _function_call_item(response_id, k, c.id, c.name, c.arguments, "completed", names)
        for k, c in enumerate(choice.tool_calls)
    )
    return items


def responses_usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """What every `response` object of one request repeats: the request (its fields are
    echoed), the id, the creation time, the model and the sampling as actually used."""

    request: ResponsesRequest
    response_id: str
    created_at: float
    model: str
    sampling: SamplingSpec

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: Usage | None,
        incomplete: bool = False,
    ) -> dict[str, Any]:
        """The `response` object in `status` with `output`."""
        request, sampling = self.request, self.sampling
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": None if usage is None else responses_usage(usage),
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": request.instructions,
            "tools": list(request.tools or ()),
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_output_tokens": request.max_output_tokens,
            "top_logprobs": request.top_logprobs,
            "previous_response_id": request.previous_response_id,
            "reasoning": request.reasoning,
            "text": request.text or {"format": {"type": "text"}},
            "truncation": request.truncation or "disabled",
            "metadata": request.metadata or {},
            "store": bool(request.store),
            "user": request.user,
            "background": False,
        }

    def finished(
        self, choice: ParsedChoice, usage: Usage, signer: Signer | None = None
    ) -> dict[str, Any]:
        """A finished `response` body: `completed`, or `incomplete` (reason
        `max_output_tokens`) when the output was cut off by length. `signer` seals the
        reasoning when the request includes `reasoning.encrypted_content`."""
        request = self.request
        incomplete = choice.finish_reason == "length"
        sealing = signer if ENCRYPTED_REASONING in (request.include or ()) else None
        return self.body(
            "incomplete" if incomplete else "completed",
            output_items(self.response_id, choice, tool_names(request.tools), sealing),
            usage,
            incomplete,
        )


def build_response(
    request: ResponsesRequest,
    *,
    response_id: str,
    created_at: float,
    model: str,
    choice: ParsedChoice,
    usage: Usage,
    sampling: SamplingSpec,
    signer: Signer | None = None,
) -> dict[str, Any]:
    """`ResponseHead.finished` of one request's reply."""
    head = ResponseHead(request, response_id, created_at, model, sampling)
    return head.finished(choice, usage, signer)


class ResponsesStreamAssembler(BlockStream):
    """Responses SSE events (dicts with `type` and `sequence_number`) for one choice.

    `start()`: response.created, response.in_progress. Then per step, the blocks of
    `gateway.wires.blocks` as output items: a reasoning item (reasoning_text deltas), a
    message item (output_text deltas), a function_call item per call as the OpenAI
    Responses API streams one: output_item.added (call_id, name, empty arguments) as
    soon as the name is known, function_call_arguments.delta as the arguments are
    generated, then arguments.done and output_item.done once the call closes. Items come
    in `build_response`'s order, and their done items equal its items, except that a
    message closed by a call carries the logprobs of the tokens before the call
    (`response.completed` has them all) and a call that started streaming but turned out
    malformed or cut off ends `incomplete` (the reply keeps its text). Always ends with
    `response.completed` carrying the full response (status `incomplete` inside it when
    cut off by length).
    """

    def __init__(
        self,
        request: ResponsesRequest,
        tokenizer: ChatTokenizer,
        *,
        response_id: str,
        created_at: float,
        model: str,
        sampling: SamplingSpec,
        prompt_tokens: int,
        parse_tools: bool,
        logprobs: int | None = None,
        signer: Signer | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__(
            tokenizer,
            response_id,
            parse_tools=parse_tools,
            stop=sampling.stop,
            tools=tools,
            logprobs=logprobs,
        )
        self._signer = signer
        self._names = tool_names(request.tools)
        self._sealing = signer if ENCRYPTED_REASONING in (request.include or ()) else None
        self._rid = response_id
        self._head = ResponseHead(request, response_id, created_at, model, sampling)
        self._prompt_tokens = prompt_tokens
        self._seq = 0
        self._events: list[dict[str, Any]] = []
        self._output: list[dict[str, Any]] = []
        self._item: dict[str, Any] | None = None
        """The open block's item (text or call)."""
        self._text = ""
        """The open text item's text, or the open call's arguments sent so far."""
        self._messages = 0
        """Message items done so far."""
        self._lps: list[TokenLogprob] = []
        """Logprobs of the tokens so far (when asked for), for a message a call closes."""
        self._final: dict[str, dict[str, Any]] = {}
        """At the end: the reply's reasoning and message items, by type."""
        self._cached_tokens = 0
        self.response: dict[str, Any] | None = None
        """The final response body (also in `response.completed`)."""

    def start(self) -> list[dict[str, Any]]:
        body = self._head.body("in_progress", [], None)
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def update(self, choice: GeneratedChoice) -> list[dict[str, Any]]:
        """Events for the next cumulative output."""
        self._cached_tokens = choice.cached_tokens
        return self._step(self.stream.update(choice))

    def push(
        self,
        new_ids: Sequence[int],
        new_logprobs: Sequence[float],
        finish: FinishReason | None,
        *,
        new_top: Sequence[tuple[tuple[int, float], ...]] = (),
        cached_tokens: int = 0,
    ) -> list[dict[str, Any]]:
        """Events for new tokens only (backend deltas); `finish` set on the last push."""
        self._cached_tokens = cached_tokens
        return self._step(self.stream.push(new_ids, new_logprobs, finish, new_top=new_top))

    def _step(self, delta: StreamDelta) -> list[dict[str, Any]]:
        events = self._events = [] if self._seq else self.start()
        if delta.logprobs:
            self._lps.extend(delta.logprobs)
        if delta.finished is not None:  # the blocks still open close as the reply's items
            final = output_items(self._rid, delta.finished, self._names, self._sealing)
            self._final = {i["type"]: i for i in final if i["type"] != "function_call"}
        self.feed(delta)
        return events

    def fail(self, code: str, message: str) -> list[dict[str, Any]]:
        """`response.failed` for an error after the stream started."""
        body = self._head.body("failed", list(self._output), None)
        body["error"] = {"code": code, "message": message}
        return [self._event("response.failed", response=body)]

    # ------------------------------------------------------------ blocks as items

    def on_open_text(self, kind: TextKind) -> None:
        if kind == REASONING:
            item = _reasoning_item(self._rid, "", "in_progress")
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                **_message_item(self._rid, None, "in_progress"),
                "id": _item_id("msg", self._rid, self._messages),
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._item, self._text = item, ""
        self._emit("response.output_item.added", output_index=len(self._output), item=item)
        self._emit("response.content_part.added", **self._where(), part=part)

    def on_text(self, kind: TextKind, text: str) -> None:
        self._text += text
        if kind == REASONING:
            self._emit("response.reasoning_text.delta", **self._where(), delta=text)
        else:
            self._events.append(  # per token: no `_emit` hop
                self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])
            )

    def on_close_text(self, kind: TextKind) -> None:
        assert self._item is not None
        if kind == REASONING:
            done = self._final.get("reasoning") or _reasoning_item(
                self._rid, self._text, "completed", self._sealing
            )
            part = {"type": "reasoning_text", "text": self._text}
            self._emit("response.reasoning_text.done", **self._where(), text=self._text)
        else:
            done = (None if self._messages else self._final.get("message")) or {
                **_message_item(
                    self._rid, self._text, "completed", [t.to_openai() for t in self._lps]
                ),
                "id": self._item["id"],
            }
            part = done["content"][0]
            where = self._where()
            self._emit(
                "response.output_text.done", **where, text=self._text, logprobs=part["logprobs"]
            )
            self._messages += 1
        self._emit("response.content_part.done", **self._where(), part=part)
        self._emit("response.output_item.done", output_index=len(self._output), item=done)
        self._output.append(done)
        self._item = None

    def on_open_call(self, index: int, head: ToolCall) -> None:
        item = _function_call_item(
            self._rid, index, head.id, head.name, "", "in_progress", self._names
        )
        self._item, self._text = item, ""
        self._emit("response.output_item.added", output_index=len(self._output), item=item)

    def on_arguments(self, index: int, text: str, whole: ToolCall | None) -> None:
        assert self._item is not None
        self._text += text
        self._emit(
            "response.function_call_arguments.delta",
            item_id=self._item["id"],
            output_index=len(self._output),
            delta=text,
        )

    def on_close_call(self, index: int, completed: ToolCall | None, superseded: bool) -> None:
        """A completed call's item is the parsed call's; another keeps the arguments
        sent, `completed` when the next call began, else `incomplete`."""
        assert self._item is not None
        if completed is not None:
            item = _function_call_item(
                self._rid,
                index,
                completed.id,
                completed.name,
                completed.arguments,
                "completed",
                self._names,
            )
        else:
            status = "completed" if superseded else "incomplete"
            item = {**self._item, "arguments": self._text, "status": status}
        self._item = None
        index = len(self._output)
        self._output.append(item)
        self._emit(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            arguments=item["arguments"],
            name=item["name"],
        )
        self._emit("response.output_item.done", output_index=index, item=item)

    def owes_text(self, choice: ParsedChoice) -> bool:
        return _has_message(choice) and not self._messages

    def on_finish(self, choice: ParsedChoice) -> None:
        usage = Usage.of(self._prompt_tokens, [choice], self._cached_tokens)
        self.response = self._head.finished(choice, usage, self._signer)
        self._emit("response.completed", response=self.response)

    def _where(self) -> dict[str, Any]:
        assert self._item is not None
        return {"item_id": self._item["id"], "output_index": len(self._output), "content_index": 0}

    def _emit(self, kind: str, **fields: Any) -> None:
        self._events.append(self._event(kind, **fields))

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event
