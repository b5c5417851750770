"""The Responses wire's translate in: a request -> chat messages and nested tools (pure),
after `previous_response_id` is resolved from the store into the input it stands for.

Items: `instructions` -> a leading system message; message items by role; consecutive
`function_call` items (and an assistant message right before them) -> one assistant
message with several tool_calls; `function_call_output` -> a tool message; a
`reasoning` item -> reasoning_content of the next assistant message. Our output items
replayed as input therefore merge back into ONE assistant message that re-renders the
generated text, so ids prefix the next prompt as on chat.

Codex: `namespace` tools are flattened into function tools named `<namespace>.<name>`
(a `.` never occurs in a function name, so the split is unambiguous); a call of one
comes back as a `function_call` item with `namespace` and the bare `name`, and such an
item replayed renders under the flat name again. Hosted tools (`web_search`, ...) follow
`gateway.hosted_tools`. With `include: ["reasoning.encrypted_content"]` a reasoning item
carries its text sealed (`gateway.signing`), which `store: false` clients send back.

`previous_response_id`: every response is a stored completion (its request and response
JSON), so a chain is rebuilt from the store: for each earlier response, oldest first,
its input items then its output items, then the new request's input. As on OpenAI,
`instructions` and `tools` are not carried over (each request sends its own). The
rebuilt conversation renders to a prompt that extends the previous prompt + output token
for token (the same property replayed items have), so the turns still merge into one
training sequence. A response is visible only to the key that created it (and to the
admin key): another key's id is answered like an unknown one, and so is one whose
request said `store: false` (Codex sends it; its completion is still captured for
training, but not kept for `previous_response_id`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from areal_service.store import TrajectoryStore
from gateway.auth import Principal
from gateway.errors import OpenAIError
from gateway.protocol import TEXT_PART_TYPES, InvalidRequestError, ToolChoice, hosted_tool
from gateway.signing import Signer
from gateway.wires.responses.protocol import ResponsesRequest

# ---------------------------------------------------------------- request -> chat

_CHAT_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


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

    def refuse_or_drop(tool: Mapping[str, Any], param: str) -> None:
        label = str(tool.get("name") or tool.get("type"))
        hosted_tool(label, tool.get("type"), hosted, param, dropped)

    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind == "function":
            flat.append(dict(tool))
        elif kind == "namespace":
            for j, member in enumerate(tool["tools"]):
                if member.get("type", "function") != "function":
                    refuse_or_drop(member, f"tools[{i}].tools[{j}]")
                    continue
                flat.append(
                    {
                        **member,
                        "type": "function",
                        "name": f"{tool['name']}{NAMESPACE_SEP}{member['name']}",
                    }
                )
        else:
            refuse_or_drop(tool, f"tools[{i}]")
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
            "previous_response_id must be resolved first (with_previous_responses)",
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


# ---------------------------------------------------------------- previous_response_id

MAX_CHAIN = 1000
"""Longest chain followed (each link is one indexed store read)."""


async def with_previous_responses(
    store: TrajectoryStore, principal: Principal, request: ResponsesRequest
) -> ResponsesRequest:
    """`request` with the stored conversation before it prepended to `input` (and
    `previous_response_id` resolved away); `request` itself when it names none."""
    if not request.previous_response_id:
        return request
    owner = None if principal.is_admin else principal.key_id
    earlier = await asyncio.to_thread(
        conversation_items, store, request.previous_response_id, owner
    )
    return request.model_copy(
        update={"input": earlier + input_items(request.input), "previous_response_id": None}
    )


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's `input` as a list of items (a string is one user message)."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else list(value)


def conversation_items(
    store: TrajectoryStore, response_id: str, owner: str | None
) -> list[dict[str, Any]]:
    """Input and output items of `response_id` and every response it continues, oldest
    first. 404 `previous_response_not_found` for an id that is unknown, not a Responses
    completion, or (with `owner`) created by another key."""
    chain = []
    current: str | None = response_id
    while current:
        record = store.get_completion(current)
        if (
            record is None
            or "input" not in record.request_json
            or (owner is not None and record.api_key_id != owner)
            or record.request_json.get("store") is False
        ):
            raise OpenAIError(
                404,
                f"Previous response with id '{current}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        chain.append(record)
        if len(chain) > MAX_CHAIN:
            raise OpenAIError(
                400,
                f"the response chain behind '{response_id}' is longer "
                f"than {MAX_CHAIN}; resend the conversation in `input`",
                param="previous_response_id",
            )
        current = record.request_json.get("previous_response_id")
    items: list[dict[str, Any]] = []
    for record in reversed(chain):
        items += input_items(record.request_json["input"])
        items += list(record.response_json.get("output") or ())
    return items
