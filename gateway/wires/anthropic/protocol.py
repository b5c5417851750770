"""The Anthropic Messages wire's models: the `POST /v1/messages` and
`/v1/messages/count_tokens` bodies (Claude Code, the `anthropic` SDKs). Unknown fields
are accepted and kept (`metadata`, `thinking`, `context_management`, `output_config`,
`cache_control` on blocks, ...); a content block the text-only policy cannot take fails
validation. Anthropic-defined tools the policy cannot run (`web_search_*`, `bash_*`,
... : a `type` and no `input_schema`) are `is_hosted`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from gateway.protocol import ClientSampling, InvalidRequestError, OpenModel

TEXT_BLOCKS = frozenset({"text"})
_IGNORED_BLOCKS = frozenset({"redacted_thinking", "server_tool_use", "web_search_tool_result"})
"""Blocks accepted and left out of the prompt: the policy never produced them."""


class AnthropicMessage(OpenModel):
    role: Literal["user", "assistant", "system"]
    """`system` inside `messages`: Claude Code's `mid-conversation-system` beta."""
    content: str | list[dict[str, Any]]

    @field_validator("content")
    @classmethod
    def _blocks(cls, content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(content, list):
            for block in content:
                check_block(block)
        return content


def check_block(block: Mapping[str, Any]) -> None:
    """ValueError for a content block the text-only policy cannot take."""
    kind = block.get("type")
    if kind in TEXT_BLOCKS:
        if not isinstance(block.get("text"), str):
            raise ValueError("a text block needs a string `text`")
    elif kind == "thinking":
        if not isinstance(block.get("thinking"), str):
            raise ValueError("a thinking block needs a string `thinking`")
    elif kind == "tool_use":
        if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
            raise ValueError("a tool_use block needs a string `id` and `name`")
    elif kind == "tool_result":
        if not isinstance(block.get("tool_use_id"), str):
            raise ValueError("a tool_result block needs a string `tool_use_id`")
        content = block.get("content")
        if isinstance(content, list):
            for part in content:
                if part.get("type") not in TEXT_BLOCKS:
                    raise ValueError(
                        f"tool_result content of type {part.get('type')!r} is "
                        "not supported: the served model is text-only"
                    )
        elif content is not None and not isinstance(content, str):
            raise ValueError("tool_result `content` must be a string or text blocks")
    elif kind in ("image", "document", "search_result", "container_upload"):
        raise ValueError(
            f"content blocks of type {kind!r} are not supported: the served "
            "model is text-only; send text blocks or a string"
        )
    elif kind not in _IGNORED_BLOCKS:
        raise ValueError(f"unknown content block type {kind!r}")


class MessagesRequest(OpenModel):
    """`POST /v1/messages` body (Anthropic Messages API)."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    """Required by Anthropic; optional here (the gateway's default applies)."""
    stop_sequences: list[str] | None = None
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, ge=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1, le=2**31 - 1)
    stream: StrictBool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("system")
    @classmethod
    def _system_text(
        cls, system: str | list[dict[str, Any]] | None
    ) -> str | list[dict[str, Any]] | None:
        for block in system if isinstance(system, list) else ():
            if block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise ValueError("`system` blocks must be text blocks")
        return system

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for tool in tools or ():
            if not isinstance(tool.get("name"), str):
                raise ValueError("every tool needs a string `name`")
            if not is_hosted(tool) and not isinstance(tool.get("input_schema"), dict):
                raise ValueError(f"tool {tool['name']!r} needs an `input_schema` object")
        return tools

    @model_validator(mode="after")
    def _choosable(self) -> MessagesRequest:
        choice = self.tool_choice
        if choice is not None and choice.get("type") not in ("auto", "any", "tool", "none"):
            raise InvalidRequestError(
                "tool_choice.type must be auto, any, tool or none", param="tool_choice"
            )
        if choice is not None and choice.get("type") == "tool":
            names = [t["name"] for t in self.tools or () if not is_hosted(t)]
            if choice.get("name") not in names:
                raise InvalidRequestError(
                    f"tool_choice names the tool {choice.get('name')!r}, which is not among "
                    f"the tools ({', '.join(names) or 'none'})",
                    param="tool_choice",
                )
        return self

    def wants_logprobs(self) -> int | None:
        return None  # the Messages API has no logprobs (they are recorded regardless)

    def client_sampling(self) -> ClientSampling:
        return ClientSampling(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=tuple(self.stop_sequences or ()),
        )


class CountTokensRequest(OpenModel):
    """`POST /v1/messages/count_tokens` body: a Messages request without sampling."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None

    _system_text = field_validator("system")(MessagesRequest._system_text.__func__)  # type: ignore[attr-defined]
    _tools = field_validator("tools")(MessagesRequest._tools.__func__)  # type: ignore[attr-defined]


def is_hosted(tool: Mapping[str, Any]) -> bool:
    """An Anthropic-defined tool (`web_search_20250305`, `bash_20250124`, ...): typed, no
    schema of its own, so the policy has nothing to render for it."""
    kind = tool.get("type")
    return kind not in (None, "custom") and "input_schema" not in tool
