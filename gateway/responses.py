"""OpenAI Responses API <-> chat (pure: no HTTP, no store): input items and flat tools ->
chat messages and nested tools for `gateway/translate.py`; a finished choice -> a `response`
body (reasoning / message / function_call items) or the SSE events ending in
`response.completed`. Our output items replayed as input merge back into ONE assistant
message that re-renders the generated text, so ids prefix the next prompt as on chat.

Codex: `namespace` tools are flattened into function tools named `<namespace>.<name>`
(a `.` never occurs in a function name, so the split is unambiguous); a call of one
comes back as a `function_call` item with `namespace` and the bare `name`, and such an
item replayed renders under the flat name again. Hosted tools (`web_search`, ...) follow
`gateway.hosted_tools`. With `include: ["reasoning.encrypted_content"]` a reasoning item
carries its text sealed (`gateway.signing`), which `store: false` clients send back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from areal_service.sglang_protocol import FinishReason
from gateway.chat_stream import ChoiceStream, StreamDelta
from gateway.protocol import TEXT_PART_TYPES, InvalidRequestError, ResponsesRequest, ToolChoice
from gateway.signing import Signer
from gateway.tokenizer import ChatTokenizer
from gateway.translate import (
    GeneratedChoice,
    ParsedChoice,
    SamplingSpec,
    TokenLogprob,
    Usage,
)

_CHAT_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


# ---------------------------------------------------------------- request -> chat

NAMESPACE_SEP = "."
ToolNames = Mapping[str, tuple[str, str]]
"""Flat tool name -> (namespace, name) of the namespaced tools of a request."""
ENCRYPTED_REASONING = "reasoning.encrypted_content"


@dataclass(frozen=True, slots=True)
class ChatConversation:
    """A Responses request in chat form."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: ToolChoice | None
    dropped_tools: list[str]
    """Hosted tools left out of the prompt (`gateway.hosted_tools: drop`)."""


def flatten_tools(
    tools: Sequence[Mapping[str, Any]] | None, hosted: Literal["drop", "reject"] = "drop"
) -> tuple[list[dict[str, Any]], list[str]]:
    """(flat function tools, names of dropped hosted tools): namespace members become
    functions named `<namespace>.<name>`; any other tool type is hosted: dropped, or
    `InvalidRequestError` under `reject`."""
    flat: list[dict[str, Any]] = []
    dropped: list[str] = []

    def hosted_tool(tool: Mapping[str, Any], param: str) -> None:
        label = str(tool.get("name") or tool.get("type"))
        if hosted == "reject":
            raise InvalidRequestError(
                f"tool {label!r} of type {tool.get('type')!r} runs on the provider's side, "
                "which this gateway cannot do (gateway.hosted_tools is 'reject'; 'drop' "
                "leaves it out of the prompt)",
                param=param,
            )
        dropped.append(label)

    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind == "function":
            flat.append(dict(tool))
        elif kind == "namespace":
            for j, member in enumerate(tool["tools"]):
                if member.get("type", "function") != "function":
                    hosted_tool(member, f"tools[{i}].tools[{j}]")
                    continue
                flat.append(
                    {
                        **member,
                        "type": "function",
                        "name": f"{tool['name']}{NAMESPACE_SEP}{member['name']}",
                    }
                )
        else:
            hosted_tool(tool, f"tools[{i}]")
    return flat, dropped


def tool_names(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, tuple[str, str]]:
    """Flat name -> (namespace, name) of every namespaced function tool."""
    return {
        f"{t['name']}{NAMESPACE_SEP}{m['name']}": (t["name"], m["name"])
        for t in tools or ()
        if t.get("type") == "namespace"
        for m in t["tools"]
    }


def translate_request(
    request: ResponsesRequest,
    *,
    hosted_tools: Literal["drop", "reject"] = "drop",
    signer: Signer | None = None,
) -> ChatConversation:
    """`responses_to_chat`, with the hosted tools dropped and sealed reasoning opened
    (`signer`; without one, a reasoning item's visible text is used)."""
    if request.previous_response_id:  # resolved from the store before this hop
        raise InvalidRequestError(
            "previous_response_id must be resolved first (gateway.response_chain)",
            param="previous_response_id",
        )
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        _append_items(messages, request.input, signer)
    flat, dropped = flatten_tools(request.tools, hosted_tools)
    choice = request.tool_choice
    if isinstance(choice, Mapping) and isinstance(choice.get("namespace"), str):
        choice = {
            "type": "function",
            "name": f"{choice['namespace']}{NAMESPACE_SEP}{choice.get('name')}",
        }
    return ChatConversation(messages, chat_tools(flat), chat_tool_choice(choice), dropped)


def responses_to_chat(
    request: ResponsesRequest,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, ToolChoice | None]:
    """(chat messages, nested chat tools, chat tool_choice) for a Responses request whose
    items `ResponsesRequest` validated (`protocol.check_input_items`).

    `instructions` -> a leading system message; message items (with or without
    `"type": "message"`) by role; consecutive `function_call` items (and an assistant
    message right before them) -> one assistant message with several tool_calls;
    `function_call_output` -> a tool message; a `reasoning` item -> reasoning_content of
    the next assistant message. Item `id` / `status` are accepted and ignored.
    """
    conv = translate_request(request)
    return conv.messages, conv.tools, conv.tool_choice


def _append_items(
    messages: list[dict[str, Any]], items: Sequence[Mapping[str, Any]], signer: Signer | None = None
) -> None:
    reasoning: str | None = None
    open_assistant: dict[str, Any] | None = None  # the message function_calls merge into
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = _CHAT_ROLES[item["role"]]
            msg = {"role": role, "content": _item_text(item.get("content"))}
            open_assistant = None
            if role == "assistant":
                msg, reasoning, open_assistant = _with_reasoning(msg, reasoning), None, msg
            messages.append(msg)
        elif kind == "function_call":
            name = item["name"]
            if isinstance(item.get("namespace"), str) and item["namespace"]:
                name = f"{item['namespace']}{NAMESPACE_SEP}{name}"
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": name, "arguments": item.get("arguments", "{}")},
            }
            if open_assistant is None:
                open_assistant = _with_reasoning({"role": "assistant", "content": None}, reasoning)
                reasoning = None
                messages.append(open_assistant)
            open_assistant.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _item_text(item.get("output")),
                }
            )
            open_assistant = None
        else:  # reasoning
            reasoning = _reasoning_text(item, signer, i)
            open_assistant = None


def _with_reasoning(msg: dict[str, Any], reasoning: str | None) -> dict[str, Any]:
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


def _item_text(content: str | list[dict[str, Any]] | None) -> str:
    """Text of a message's content or a tool output: a string or text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(p["text"] for p in content if p.get("type") in TEXT_PART_TYPES)


def _reasoning_text(item: Mapping[str, Any], signer: Signer | None = None, index: int = 0) -> str:
    """The sealed text of `encrypted_content` (with a `signer`; 400 when it was not
    issued by this gateway), else the full reasoning text (`content` reasoning_text
    parts), else the summary."""
    sealed = item.get("encrypted_content")
    if signer is not None and isinstance(sealed, str) and sealed:
        text = signer.open(sealed)
        if text is None:
            raise InvalidRequestError(
                "encrypted_content was not issued by this gateway (or was altered)",
                param=f"input[{index}].encrypted_content",
            )
        return text
    parts = item.get("content") or item.get("summary") or []
    return "\n".join(p.get("text", "") for p in parts)


def chat_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools -> nested chat tools, key order kept (it is rendered
    into the prompt)."""
    if not tools:
        return None
    return [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools
    ]


def chat_tool_choice(choice: ToolChoice | None) -> ToolChoice | None:
    """`{"type": "function", "name"}` -> `{"type": "function", "function": {"name"}}`."""
    if isinstance(choice, Mapping) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


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


def _response_body(
    request: ResponsesRequest,
    *,
    response_id: str,
    created_at: float,
    model: str,
    sampling: SamplingSpec,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None,
    incomplete: bool = False,
) -> dict[str, Any]:
    """The `response` object; request fields echoed, sampling as actually used."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "model": model,
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
    """A finished `response` body: `completed`, or `incomplete` (reason
    `max_output_tokens`) when the output was cut off by length. `signer` seals the
    reasoning when the request includes `reasoning.encrypted_content`."""
    incomplete = choice.finish_reason == "length"
    sealing = signer if ENCRYPTED_REASONING in (request.include or ()) else None
    return _response_body(
        request,
        response_id=response_id,
        created_at=created_at,
        model=model,
        sampling=sampling,
        status="incomplete" if incomplete else "completed",
        output=output_items(response_id, choice, tool_names(request.tools), sealing),
        usage=usage,
        incomplete=incomplete,
    )


class ResponsesStreamAssembler:
    """Responses SSE events (dicts with `type` and `sequence_number`) for one choice.

    `start()`: response.created, response.in_progress. `update()` per cumulative output:
    a reasoning item (reasoning_text deltas) and a message item (output_text deltas)
    stream as text becomes stable; a function_call item per call streams as the OpenAI
    Responses API streams one: output_item.added (call_id, name, empty arguments) as
    soon as the name is known, function_call_arguments.delta as the arguments are
    generated (`ChoiceStream`'s call fragments, the chat stream's: they concatenate to
    the call's arguments text), then arguments.done and output_item.done once the call
    closes. Formats whose calls stream whole send one delta when the call closes. Items
    come in `build_response`'s order (a call closes the message before it), and their
    done items equal its items, except that a message closed by a call carries the
    logprobs of the tokens before the call (`response.completed` has them all) and a call
    that started streaming but turned out malformed or cut off ends `incomplete` (the
    reply keeps its text). Always ends with `response.completed` carrying the full
    response (status `incomplete` inside it when cut off by length).
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
        self._request = request
        self._signer = signer
        self._names = tool_names(request.tools)
        self._sealing = signer if ENCRYPTED_REASONING in (request.include or ()) else None
        self._rid = response_id
        self._created_at = created_at
        self._model = model
        self._sampling = sampling
        self._prompt_tokens = prompt_tokens
        self._stream = ChoiceStream(
            tokenizer,
            completion_id=response_id,
            parse_tools=parse_tools,
            stop=sampling.stop,
            logprobs=logprobs,
            tools=tools,
            call_fragments=True,
        )
        self._seq = 0
        self._output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item streaming (text or call)
        self._text = ""
        """The open text item's text, or the open call's arguments sent so far."""
        self._call = -1
        """The call index of the open function_call item."""
        self._done = 0
        """Calls completed so far (their items are done)."""
        self._messages = 0
        """Message items done so far."""
        self._lps: list[TokenLogprob] = []
        """Logprobs of the tokens so far (when asked for), for a message a call closes."""
        self.response: dict[str, Any] | None = None
        """The final response body (also in `response.completed`)."""

    @property
    def result(self) -> ParsedChoice | None:
        return self._stream.result

    def start(self) -> list[dict[str, Any]]:
        body = self._body("in_progress", [], None)
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def update(self, choice: GeneratedChoice) -> list[dict[str, Any]]:
        """Events for the next cumulative output."""
        return self._events(self._stream.update(choice), choice.cached_tokens)

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
        return self._events(
            self._stream.push(new_ids, new_logprobs, finish, new_top=new_top), cached_tokens
        )

    def _events(self, delta: StreamDelta, cached_tokens: int) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = [] if self._seq else self.start()
        if delta.logprobs:
            self._lps.extend(delta.logprobs)
        if delta.reasoning:
            events += self._text_delta("reasoning", delta.reasoning)
        if not (delta.call_fragments or delta.tool_calls):  # the common step
            if delta.content:
                events += self._text_delta("message", delta.content)
        else:
            events += self._calls(delta)
        if delta.finished is not None:
            events += self._finish(delta.finished, cached_tokens)
        return events

    def fail(self, code: str, message: str) -> list[dict[str, Any]]:
        """`response.failed` for an error after the stream started."""
        body = self._body("failed", list(self._output), None)
        body["error"] = {"code": code, "message": message}
        return [self._event("response.failed", response=body)]

    def _text_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close_open()
            events += self._open_item(kind)
        self._text += text
        suffix = "reasoning_text" if kind == "reasoning" else "output_text"
        extra: dict[str, list[Any]] = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(f"response.{suffix}.delta", **self._where(), delta=text, **extra))
        return events

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            item = _reasoning_item(self._rid, "", "in_progress")
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                **_message_item(self._rid, None, "in_progress"),
                "id": _item_id("msg", self._rid, self._messages),
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open, self._text = item, ""
        index = len(self._output)
        return [
            self._event("response.output_item.added", output_index=index, item=item),
            self._event("response.content_part.added", **self._where(), part=part),
        ]

    def _close_open(
        self, final_item: dict[str, Any] | None = None, call_status: str = "incomplete"
    ) -> list[dict[str, Any]]:
        """The done events of the open item. An open call is done with the arguments
        sent: `completed` when the next call began (formats start one only after the
        last one's arguments ended; Mistral's calls complete only when the reply does),
        `incomplete` when content or the end came instead (its text is content)."""
        if self._open is None:
            return []
        item = self._open
        if item["type"] == "function_call":  # a call the parse has not completed
            self._open = None
            return self._call_end({**item, "arguments": self._text, "status": call_status})
        if item["type"] == "reasoning":
            done = final_item or _reasoning_item(self._rid, self._text, "completed", self._sealing)
            part = {"type": "reasoning_text", "text": self._text}
            events = [self._event("response.reasoning_text.done", **self._where(), text=self._text)]
        else:
            done = final_item or {
                **_message_item(
                    self._rid, self._text, "completed", [t.to_openai() for t in self._lps]
                ),
                "id": item["id"],
            }
            part = done["content"][0]
            events = [
                self._event(
                    "response.output_text.done",
                    **self._where(),
                    text=self._text,
                    logprobs=part["logprobs"],
                )
            ]
            self._messages += 1
        events += [
            self._event("response.content_part.done", **self._where(), part=part),
            self._event("response.output_item.done", output_index=len(self._output), item=done),
        ]
        self._output.append(done)
        self._open = None
        return events

    def _calls(self, delta: StreamDelta) -> list[dict[str, Any]]:
        """Events of a step that carries call fragments or completes calls, in the order
        the text has them: the open call's arguments (and its end, if it completed),
        then content (before any new call), then the new calls."""
        frags = delta.call_fragments
        done = self._done + len(delta.tool_calls)  # calls below this index are complete
        first_head = next((k for k, f in enumerate(frags) if f.head is not None), len(frags))
        events: list[dict[str, Any]] = []
        for frag in frags[:first_head]:
            events += self._arguments(frag.index, frag.arguments)
        events += self._end_call(delta, done)
        if delta.content:
            events += self._text_delta("message", delta.content)
        for frag in frags[first_head:]:
            if frag.head is None:
                events += self._arguments(frag.index, frag.arguments)
                continue
            events += self._end_call(delta, done) + self._close_open(call_status="completed")
            item = _function_call_item(
                self._rid, frag.index, frag.head.id, frag.head.name, "", "in_progress", self._names
            )
            self._open, self._text, self._call = item, "", frag.index
            events.append(
                self._event("response.output_item.added", output_index=len(self._output), item=item)
            )
        events += self._end_call(delta, done)
        self._done = done
        return events

    def _arguments(self, index: int, text: str) -> list[dict[str, Any]]:
        item = self._open
        if item is None or item["type"] != "function_call" or self._call != index:
            return []  # ChoiceStream sends a call's arguments after its head only
        self._text += text
        return [
            self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=len(self._output),
                delta=text,
            )
        ]

    def _end_call(self, delta: StreamDelta, done: int) -> list[dict[str, Any]]:
        """arguments.done and output_item.done of the open call, if it completed."""
        item = self._open
        if item is None or item["type"] != "function_call" or self._call >= done:
            return []
        call = delta.tool_calls[self._call - self._done]
        self._open = None
        return self._call_end(
            _function_call_item(
                self._rid, self._call, call.id, call.name, call.arguments, "completed", self._names
            )
        )

    def _call_end(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        index = len(self._output)
        self._output.append(item)
        return [
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
                name=item["name"],
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _finish(self, choice: ParsedChoice, cached_tokens: int) -> list[dict[str, Any]]:
        final = output_items(self._rid, choice, self._names, self._sealing)
        by_type = {item["type"]: item for item in final if item["type"] != "function_call"}
        events = []
        if self._open is not None and self._open["type"] == "reasoning":
            events += self._close_open(by_type.get("reasoning"))
        if (
            "message" in by_type
            and not self._messages
            and (self._open is None or self._open["type"] != "message")
        ):
            events += self._close_open() + self._open_item("message")
        first = self._open is not None and self._open["type"] == "message" and not self._messages
        events += self._close_open(by_type.get("message") if first else None)
        usage = Usage.of(self._prompt_tokens, [choice], cached_tokens)
        self.response = build_response(
            self._request,
            response_id=self._rid,
            created_at=self._created_at,
            model=self._model,
            choice=choice,
            usage=usage,
            sampling=self._sampling,
            signer=self._signer,
        )
        events.append(self._event("response.completed", response=self.response))
        return events

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self._output), "content_index": 0}

    def _body(
        self, status: str, output: list[dict[str, Any]], usage: Usage | None
    ) -> dict[str, Any]:
        return _response_body(
            self._request,
            response_id=self._rid,
            created_at=self._created_at,
            model=self._model,
            sampling=self._sampling,
            status=status,
            output=output,
            usage=usage,
        )

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event
