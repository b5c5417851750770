"""The Responses wire's models: the `POST /v1/responses` body as real clients send it
(openai-gateway-contract.md §4; input items stay dicts, checked by their `type` here and
trusted by `translate`), and the `response` body as `/openapi.json` documents it (the
hot route builds it as a dict: `encode.build_response`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from gateway.protocol import (
    ClientSampling,
    InvalidRequestError,
    OpenModel,
    ToolChoice,
    check_content_part,
    check_tool_choice,
    tool_choice_value,
)

# ---------------------------------------------------------------- request


class ResponsesRequest(OpenModel):
    """`POST /v1/responses` body. Input items stay dicts: `check_input_items`
    validates each one by its `type` and names the offending `input[i]`."""

    model: str
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    """Flat form `{"type": "function", "name", "description", "parameters", "strict"}`."""
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, ge=0, le=1)
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    stream: StrictBool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    truncation: str | None = None
    user: str | None = None

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """Function tools, `namespace` tools of function tools (Codex), and hosted tools
        (`web_search`, ...: any other `type`, handled by `gateway.hosted_tools`)."""
        for tool in tools or ():
            kind = tool.get("type")
            if not isinstance(kind, str):
                raise ValueError("every tool needs a string `type`")
            if kind == "function" and not isinstance(tool.get("name"), str):
                raise ValueError(
                    'a function tool needs a string `name`: {"type": '
                    '"function", "name", "parameters"}'
                )
            if kind == "namespace":
                inner = tool.get("tools")
                if (
                    not isinstance(tool.get("name"), str)
                    or not isinstance(inner, list)
                    or not all(
                        isinstance(t, dict) and isinstance(t.get("name"), str) for t in inner
                    )
                ):
                    raise ValueError(
                        "a namespace tool needs a string `name` and `tools`: "
                        "a list of tools with a string `name`"
                    )
        return tools

    _tool_choice = field_validator("tool_choice")(tool_choice_value)

    @model_validator(mode="after")
    def _servable(self) -> ResponsesRequest:
        choice = self.tool_choice
        names = [t["name"] for t in self.tools or () if t.get("type") == "function"]
        names += [
            f"{t['name']}.{f['name']}"
            for t in self.tools or ()
            if t.get("type") == "namespace"
            for f in t["tools"]
        ]
        name = choice.get("name") if isinstance(choice, dict) else None
        if isinstance(choice, dict) and isinstance(choice.get("namespace"), str):
            name = f"{choice['namespace']}.{name}"
        check_tool_choice(choice, name, names, "tool_choice")
        if self.conversation:
            raise InvalidRequestError(
                "conversation is not supported: use previous_response_id, or resend the "
                "whole conversation in `input` (the OpenAI Agents SDK does by default)",
                param="conversation",
            )
        if isinstance(self.input, list):
            check_input_items(self.input)
            if not (self.instructions or self.previous_response_id) and all(
                item.get("type") == "reasoning" for item in self.input
            ):
                raise InvalidRequestError("`input` has no message to respond to", param="input")
        return self

    def wants_logprobs(self) -> int | None:
        """None unless `include` asks for `message.output_text.logprobs` (or
        `top_logprobs` is set), else how many top alternatives."""
        asked = "message.output_text.logprobs" in (self.include or ())
        return (self.top_logprobs or 0) if asked or self.top_logprobs else None

    def client_sampling(self) -> ClientSampling:
        top_k = (self.model_extra or {}).get("top_k")
        return ClientSampling(
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=top_k if isinstance(top_k, int) else None,
        )


_INPUT_ROLES = frozenset({"user", "system", "developer", "assistant"})
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def check_input_items(items: list[dict[str, Any]]) -> None:
    """Raise `InvalidRequestError` naming `input[i]...` for an input item this gateway
    cannot translate (`translate.translate_request` then trusts the items)."""
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            if not isinstance(item.get("role"), str) or item["role"] not in _INPUT_ROLES:
                raise InvalidRequestError(
                    f"unsupported message role {item.get('role')!r}", param=f"input[{i}].role"
                )
            check_item_text(item.get("content"), f"input[{i}].content")
        elif kind == "function_call":
            _required(item, "call_id", i)
            _required(item, "name", i)
        elif kind == "function_call_output":
            _required(item, "call_id", i)
            check_item_text(item.get("output"), f"input[{i}].output")
        elif kind == "reasoning":
            key = "content" if item.get("content") else "summary"
            parts = item.get(key) or []
            if not isinstance(parts, list) or not all(
                isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in parts
            ):
                raise InvalidRequestError(
                    f'a reasoning item\'s `{key}` must be a list of {{"type", "text"}} parts',
                    param=f"input[{i}].{key}",
                )
        else:
            raise InvalidRequestError(
                f"input item type {kind!r} is not supported (supported: "
                f"{', '.join(INPUT_ITEM_TYPES)})",
                param=f"input[{i}]",
            )


def _required(item: dict[str, Any], key: str, i: int) -> None:
    if not isinstance(item.get(key), str):
        raise InvalidRequestError(
            f"{item.get('type')} item needs a string `{key}`", param=f"input[{i}].{key}"
        )


def check_item_text(content: Any, param: str) -> None:
    """A message's content or a tool output (`param`): a string or text parts."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"`{param}` must be a string or a list of content parts", param=param
        )
    for j, part in enumerate(content):
        try:
            if not isinstance(part, dict):
                raise ValueError("a content part must be an object with a `type`")
            check_content_part(part)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param=f"{param}[{j}]") from exc


# ---------------------------------------------------------------- reply


class ResponsesUsage(OpenModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class Response(OpenModel):
    """A Responses `response`: output items are `reasoning`, `message` and
    `function_call`; `model` echoes the name the client sent."""

    id: str
    object: Literal["response"]
    created_at: float
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponsesUsage | None
