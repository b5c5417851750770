"""Pydantic request models for `/v1/chat/completions` and `/v1/responses`, as real clients
send them (openai-gateway-contract.md §3, §4, §8). Unknown fields are accepted and kept;
what the text-only model cannot honour (image/audio/file parts, non-function tools) fails
validation naming the field (routes answer 400 `invalid_request_error`). No translation
here: `gateway/translate.py` and `gateway/responses.py` own that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

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


class _Open(BaseModel):
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


class FunctionCallModel(_Open):
    """`{"name", "arguments"}`; arguments is a JSON string on the wire (a mapping from
    lax clients is rendered with tojson)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallModel(_Open):
    id: str | None = None
    type: str = "function"
    function: FunctionCallModel


class ChatMessage(_Open):
    """Any chat role; role-specific fields are optional and checked only where needed."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallModel] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    function_call: FunctionCallModel | None = None
    """Legacy assistant form of a single tool call."""

    @field_validator("content")
    @classmethod
    def _text_only(
        cls, content: str | list[dict[str, Any]] | None
    ) -> str | list[dict[str, Any]] | None:
        if isinstance(content, list):
            for part in content:
                check_content_part(part)
        return content


class StreamOptions(_Open):
    include_usage: StrictBool | None = None


def _check_tool_choice(choice: ToolChoice | None) -> ToolChoice | None:
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or an object")
    return choice


class ChatCompletionRequest(_Open):
    """`POST /v1/chat/completions` body."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    """Nested form `{"type": "function", "function": {...}}`, kept as sent (key order
    included) because the template renders each tool's JSON into the prompt."""
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[dict[str, Any]] | None = None
    """Legacy form of `tools` (bare function definitions)."""
    function_call: ToolChoice | None = None
    """Legacy form of `tool_choice`."""
    stop: str | list[str] | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    min_tokens: StrictInt | None = Field(None, ge=0)
    """vLLM's extension (also SGLang's `min_new_tokens`), honoured so clients moving from
    vLLM's own endpoint keep their output lengths."""
    ignore_eos: StrictBool | None = None
    """vLLM's and SGLang's extension: generate through EOS."""
    n: StrictInt = Field(1, ge=1, le=128)
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1)
    """int64, as OpenAI documents; choice i samples with seed + i, which stays within
    what torch generators accept (larger values crash the local engine's scheduler)."""
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, ge=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1, le=2**31 - 1)
    """Extension (vLLM/SGLang `extra_body`): -1 or 0 (disabled) or >= 1."""
    frequency_penalty: StrictFloat | None = Field(None, ge=-2, le=2)
    presence_penalty: StrictFloat | None = Field(None, ge=-2, le=2)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    logit_bias: dict[str, StrictFloat] | None = None
    """Token id (a decimal string, as OpenAI sends it) -> bias in [-100, 100] added to
    its logit before sampling: SGLang's `logit_bias` sampling param."""
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    metadata: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    """Accepted; not enforced (decoding is not constrained)."""
    user: str | None = None

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for tool in tools or ():
            fn = tool.get("function")
            if (
                tool.get("type") != "function"
                or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)
            ):
                raise ValueError(
                    'only function tools are supported: {"type": "function", '
                    '"function": {"name", "description", "parameters"}}'
                )
        return tools

    @field_validator("functions")
    @classmethod
    def _named_functions(
        cls, functions: list[dict[str, Any]] | None
    ) -> list[dict[str, Any]] | None:
        for fn in functions or ():
            if not isinstance(fn.get("name"), str):
                raise ValueError(
                    'each of functions needs a name: {"name", "description", "parameters"}'
                )
        return functions

    _tool_choice = field_validator("tool_choice")(_check_tool_choice)

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not (token.isascii() and token.isdigit()):
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values are in [-100, 100], got {value}")
        return bias

    @model_validator(mode="after")
    def _choosable(self) -> ChatCompletionRequest:
        choice = self.chat_tool_choice()
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        check_tool_choice(
            choice,
            name,
            [t["function"]["name"] for t in self.chat_tools() or ()],
            "tool_choice" if self.tool_choice is not None else "function_call",
        )
        return self

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """`tools`, or the legacy `functions` wrapped as tools."""
        if self.tools:
            return self.tools
        if self.functions:
            return [{"type": "function", "function": fn} for fn in self.functions]
        return None

    def chat_tool_choice(self) -> ToolChoice | None:
        """`tool_choice`, or the legacy `function_call` in tool_choice form."""
        if self.tool_choice is not None or self.function_call is None:
            return self.tool_choice
        if isinstance(self.function_call, dict):
            return {"type": "function", "function": self.function_call}
        return self.function_call

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages as plain dicts (None fields dropped) for `translate.normalize_messages`."""
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def wants_logprobs(self) -> int | None:
        """None when logprobs were not requested, else how many top alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def client_sampling(self) -> ClientSampling:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return ClientSampling(
            max_tokens=self.max_completion_tokens or self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            n=self.n,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=tuple((int(t), b) for t, b in (self.logit_bias or {}).items()),
            min_tokens=self.min_tokens or 0,
            ignore_eos=bool(self.ignore_eos),
        )


class ResponsesRequest(_Open):
    """`POST /v1/responses` body. Input items stay dicts: `responses.responses_to_chat`
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

    _tool_choice = field_validator("tool_choice")(_check_tool_choice)

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
    cannot translate (`responses.responses_to_chat` then trusts the items)."""
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
