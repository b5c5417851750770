"""Pydantic models of the OpenAI reply bodies, as `/openapi.json` documents them.

The hot routes build these bodies as plain dicts (`translate.build_chat_completion`,
`responses.build_response`): a model instance per reply would cost more than the JSON
encoding itself. The models here state the shape those builders produce; a test checks
that real replies validate against them. Only the fields clients read are typed
closely; the rest are open (`extra="allow"`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error the gateway returns: `{"error": {message, type, param, code}}`."""

    error: ErrorDetail


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """JSON text, as the model wrote it."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: dict[str, Any] | None


class ChatUsage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(_Open):
    """`chat.completion`; `model` echoes the name the client sent."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage


class ResponsesUsage(_Open):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class Response(_Open):
    """A Responses `response`: output items are `reasoning`, `message` and
    `function_call`; `model` echoes the name the client sent."""

    id: str
    object: Literal["response"]
    created_at: float
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponsesUsage | None


class Model(BaseModel):
    """A model card of `/v1/models`."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]
