"""The Anthropic Messages wire's translate in: a request -> chat messages and tools (pure).

`system` (a string or text blocks) -> a leading system message; `messages` with content
blocks -> chat messages: `text` blocks join into one message, an assistant's `thinking`
block becomes its `reasoning_content` and its `tool_use` blocks its `tool_calls`
(`input` re-encoded as the arguments JSON), a user's `tool_result` blocks become `tool`
messages (before the user's own text, as Anthropic orders them); tools
`{name, description, input_schema}` -> chat function tools. Our reply replayed as history
therefore re-renders the generated text, so token continuity and parent links work as on
the OpenAI routes. Hosted tools follow `gateway.hosted_tools`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.protocol import HostedToolRule, InvalidRequestError, ToolChoice, hosted_tool
from gateway.signing import Signer
from gateway.wires.anthropic.protocol import (
    TEXT_BLOCKS,
    CountTokensRequest,
    MessagesRequest,
    is_hosted,
)


def anthropic_to_chat(
    request: MessagesRequest | CountTokensRequest,
    *,
    hosted_tools: HostedToolRule = "drop",
    signer: Signer | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, ToolChoice | None, list[str]]:
    """(chat messages, chat tools, chat tool_choice, names of dropped hosted tools).
    Raises `InvalidRequestError` for a hosted tool under `hosted_tools: reject`, and,
    with a `signer`, for a thinking block whose `signature` this gateway did not issue
    for its text (as Anthropic's API refuses a forged or edited one): replayed thinking
    goes into the prompt as the policy's own reasoning."""
    messages: list[dict[str, Any]] = []
    system = system_text(request.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(request.messages):
        if m.role == "user":
            _append_user(messages, m.content)
        elif m.role == "system":
            messages.append({"role": "system", "content": _text_of(m.content)})
        else:
            if signer is not None:
                _check_signatures(m.content, signer, i)
            messages.append(_assistant(m.content))
    tools, dropped = chat_tools(request.tools, hosted_tools)
    return messages, tools, chat_tool_choice(request.tool_choice), dropped


def system_text(system: str | Sequence[Mapping[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n".join(b["text"] for b in system)


def _text_of(content: str | Sequence[Mapping[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(b["text"] for b in content if b.get("type") in TEXT_BLOCKS)


def _append_user(messages: list[dict[str, Any]], content: str | list[dict[str, Any]]) -> None:
    if isinstance(content, str):
        messages.append({"role": "user", "content": content})
        return
    texts: list[str] = []
    for block in content:
        if block["type"] == "tool_result":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": block["tool_use_id"],
                    "content": _text_of(block.get("content")),
                }
            )
        elif block["type"] in TEXT_BLOCKS:
            texts.append(block["text"])
    if texts or not any(b["type"] == "tool_result" for b in content):
        messages.append({"role": "user", "content": "\n".join(texts)})


def _check_signatures(content: str | list[dict[str, Any]], signer: Signer, index: int) -> None:
    if isinstance(content, str):
        return
    for j, block in enumerate(content):
        if block["type"] == "thinking" and not signer.verify(
            block["thinking"], str(block.get("signature") or "")
        ):
            raise InvalidRequestError(
                "invalid signature in thinking block: it was not issued by this gateway "
                "for this text",
                param=f"messages.{index}.content.{j}.signature",
            )


def _assistant(content: str | list[dict[str, Any]]) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block["type"]
        if kind in TEXT_BLOCKS:
            texts.append(block["text"])
        elif kind == "thinking":
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {
                        "name": block["name"],
                        "arguments": arguments_text(block.get("input")),
                    },
                }
            )
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def arguments_text(value: Any) -> str:
    """A tool_use `input` as the arguments JSON. `json.dumps` spacing is what Qwen-style
    models write (`{"a": 2}`): a call replayed renders the generated text again, and its
    arguments match the reply's for token continuity. A `_raw` input (arguments that were
    not a JSON object) is replayed as sent."""
    if isinstance(value, Mapping) and set(value) == {_RAW} and isinstance(raw := value[_RAW], str):
        return raw
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


_RAW = "_raw_arguments"


def tool_input(arguments: str) -> dict[str, Any]:
    """A generated call's arguments as a tool_use `input` object (Anthropic requires an
    object; other JSON is wrapped so it round-trips through `arguments_text`)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if isinstance(value, dict) and json.dumps(value, ensure_ascii=False) == arguments:
        return value
    if isinstance(value, dict):
        return value  # spacing differs: continuity falls back to a full render
    return {_RAW: arguments}


def chat_tools(
    tools: Sequence[Mapping[str, Any]] | None, hosted: HostedToolRule
) -> tuple[list[dict[str, Any]] | None, list[str]]:
    """Anthropic tools -> nested chat function tools (description only when sent), and
    the names of hosted tools dropped."""
    out: list[dict[str, Any]] = []
    dropped: list[str] = []
    for i, tool in enumerate(tools or ()):
        if is_hosted(tool):
            hosted_tool(str(tool["name"]), tool.get("type"), hosted, f"tools[{i}]", dropped)
            continue
        fn: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description"):
            fn["description"] = tool["description"]
        fn["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": fn})
    return out or None, dropped


def chat_tool_choice(choice: Mapping[str, Any] | None) -> ToolChoice | None:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice["name"]}}
    return {"any": "required", "none": "none"}.get(str(kind), "auto")
