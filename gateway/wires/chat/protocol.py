"""The chat wire's models: the `POST /v1/chat/completions` body as real clients send it
(openai-gateway-contract.md §3, §8), and the reply bodies as `/openapi.json` documents
them. The hot route builds its replies as plain dicts (`encode.build_chat_completion`): a
model instance per reply would cost more than the JSON encoding itself; a test checks
that real replies validate against these models. Only the fields clients read are
typed closely; the rest are open.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

from gateway.protocol import (
    ClientSampling,
    OpenModel,
    ToolChoice,
    check_content_part,
    check_tool_choice,
    tool_choice_value,
)

# ---------------------------------------------------------------- request


class FunctionCallModel(OpenModel):
    """`{"name", "arguments"}`; arguments is a JSON string on the wire (a mapping from
    lax clients is rendered with tojson)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallModel(OpenModel):
    id: str | None = None
    type: str = "function"
    function: FunctionCallModel


class ChatMessage(OpenModel):
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


class StreamOptions(OpenModel):
    include_usage: StrictBool | None = None


class ChatCompletionRequest(OpenModel):
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

    _tool_choice = field_validator("tool_choice")(tool_choice_value)

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


# ---------------------------------------------------------------- reply


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """JSON text, as the model wrote it."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(OpenModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(OpenModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: dict[str, Any] | None


class ChatUsage(OpenModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(OpenModel):
    """`chat.completion`; `model` echoes the name the client sent."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage
