"""What every wire's request model shares (each wire's own models are in its room,
`gateway/wires/<wire>/protocol.py`): the error a request the gateway cannot serve
raises, the sampling fields a client sent, and the checks of content parts and tool
choices. Unknown fields are accepted and kept (`OpenModel`); what the text-only model
cannot honour fails validation naming the field (400 `invalid_request_error`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
"""Content part types whose `text` is rendered; `refusal` parts are accepted and dropped."""
_NON_TEXT_PART_TYPES = frozenset(
    {"image_url", "input_image", "input_audio", "file", "input_file", "audio"}
)
ToolChoice = str | dict[str, Any]


class InvalidRequestError(Exception):
    """A request the gateway cannot serve: 400 `invalid_request_error` naming `param`.
    Not a ValueError on purpose: raised in a model validator it passes through pydantic
    unwrapped, so the precise `param` (`input[2].call_id`) reaches the client."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class ClientSampling:
    """The sampling fields a client sent (None: not sent); resolved by
    `translate.resolve_sampling` against the context length and the sampling mode."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias added to its logit) pairs."""
    min_tokens: int = 0
    """vLLM's and SGLang's extension: no EOS or stop before this many tokens."""
    ignore_eos: bool = False
    """vLLM's and SGLang's extension: generate through EOS (to the length limit)."""


def check_tool_choice(choice: ToolChoice | None, name: Any, tools: list[str], param: str) -> None:
    """`InvalidRequestError` for a tool choice no offered tool can satisfy: `required`
    or a named function without tools, or a function that is not among them (it would
    be silently ignored: decoding is not constrained)."""
    if choice == "required" and not tools:
        raise InvalidRequestError("tool_choice 'required' needs `tools`", param=param)
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(name, str):
            raise InvalidRequestError(
                "a function tool_choice needs the function's `name`", param=param
            )
        if name not in tools:
            raise InvalidRequestError(
                f"tool_choice names the function {name!r}, which is "
                f"not among the tools ({', '.join(tools) or 'none'})",
                param=param,
            )


class OpenModel(BaseModel):
    """Accepts and keeps fields this gateway does not model (clients send many)."""

    model_config = ConfigDict(extra="allow")


def check_content_part(part: dict[str, Any]) -> None:
    """Raise ValueError for a part the text-only model cannot take."""
    kind = part.get("type")
    if not isinstance(kind, str):
        raise ValueError("a content part needs a string `type`")
    if kind in _NON_TEXT_PART_TYPES:
        raise ValueError(
            f"content parts of type {kind!r} are not supported: the served "
            "model is text-only; send text parts or a string"
        )
    if kind in TEXT_PART_TYPES and not isinstance(part.get("text"), str):
        raise ValueError(f"a {kind!r} content part needs a string `text`")
    if kind not in TEXT_PART_TYPES and kind != "refusal":
        raise ValueError(f"unknown content part type {kind!r}")


def tool_choice_value(choice: ToolChoice | None) -> ToolChoice | None:
    """ValueError for a string tool_choice that is none of the three."""
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or an object")
    return choice


HostedToolRule = Literal["drop", "reject"]
"""`gateway.hosted_tools`: what to do with a tool that runs on the provider's side."""


def hosted_tool(
    label: str, kind: Any, rule: HostedToolRule, param: str, dropped: list[str]
) -> None:
    """A tool of type `kind` that runs on the provider's side (`web_search`, ...):
    `InvalidRequestError` under `reject`, else `label` noted in `dropped` (the tool is
    left out of the prompt)."""
    if rule == "reject":
        raise InvalidRequestError(
            f"tool {label!r} of type {kind!r} runs on the provider's side, which this "
            "gateway cannot do (gateway.hosted_tools is 'reject'; 'drop' leaves it out "
            "of the prompt)",
            param=param,
        )
    dropped.append(label)
