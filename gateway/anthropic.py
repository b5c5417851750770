"""Anthropic Messages API <-> chat (pure: no HTTP, no store), for Claude Code and the
`anthropic` SDKs on `POST /v1/messages`.

Request: `system` (a string or text blocks) -> a leading system message; `messages`
with content blocks -> chat messages: `text` blocks join into one message, an assistant's
`thinking` block becomes its `reasoning_content` and its `tool_use` blocks its
`tool_calls` (`input` re-encoded as the arguments JSON), a user's `tool_result` blocks
become `tool` messages (before the user's own text, as Anthropic orders them); tools
`{name, description, input_schema}` -> chat function tools. Our reply replayed as history
therefore re-renders the generated text, so token continuity and parent links work as on
the OpenAI routes. Anthropic-defined tools the policy cannot run (`web_search_*`,
`bash_*`, ... : a `type` and no `input_schema`) follow `gateway.hosted_tools`.

Reply: a `message` with `thinking` / `text` / `tool_use` blocks, or the SSE events
Anthropic clients parse (`message_start`, `content_block_start|delta|stop`,
`message_delta`, `message_stop`, `ping`). Errors on this route take Anthropic's shape
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
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

from areal_service.sglang_protocol import FinishReason
from gateway.chat_stream import ChoiceStream, StreamDelta
from gateway.errors import OpenAIError
from gateway.protocol import ClientSampling, InvalidRequestError, ToolChoice
from gateway.signing import Signer
from gateway.tokenizer import ChatTokenizer
from gateway.toolparse.base import json_object_or_none
from gateway.translate import ParsedChoice, SamplingSpec, Usage

HostedToolRule = Literal["drop", "reject"]

_TEXT_BLOCKS = frozenset({"text"})
_IGNORED_BLOCKS = frozenset({"redacted_thinking", "server_tool_use", "web_search_tool_result"})
"""Blocks accepted and left out of the prompt: the policy never produced them."""


class _Open(BaseModel):
    """Accepts and keeps fields this gateway does not model (`metadata`, `thinking`,
    `context_management`, `output_config`, `cache_control` on blocks, ...)."""

    model_config = ConfigDict(extra="allow")


class AnthropicMessage(_Open):
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
    if kind in _TEXT_BLOCKS:
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
                if part.get("type") not in _TEXT_BLOCKS:
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


class MessagesRequest(_Open):
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


class CountTokensRequest(_Open):
    """`POST /v1/messages/count_tokens` body: a Messages request without sampling."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None

    _system_text = field_validator("system")(MessagesRequest._system_text.__func__)  # type: ignore[attr-defined]
    _tools = field_validator("tools")(MessagesRequest._tools.__func__)  # type: ignore[attr-defined]


# ---------------------------------------------------------------- request -> chat


def is_hosted(tool: Mapping[str, Any]) -> bool:
    """An Anthropic-defined tool (`web_search_20250305`, `bash_20250124`, ...): typed, no
    schema of its own, so the policy has nothing to render for it."""
    kind = tool.get("type")
    return kind not in (None, "custom") and "input_schema" not in tool


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
    return "\n".join(b["text"] for b in content if b.get("type") in _TEXT_BLOCKS)


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
        elif block["type"] in _TEXT_BLOCKS:
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
        if kind in _TEXT_BLOCKS:
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
            if hosted == "reject":
                raise InvalidRequestError(
                    f"tool {tool['name']!r} of type {tool.get('type')!r} runs on the "
                    "provider's side, which this gateway cannot do (gateway.hosted_tools "
                    "is 'reject'; 'drop' leaves it out of the prompt)",
                    param=f"tools[{i}]",
                )
            dropped.append(str(tool["name"]))
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


# ---------------------------------------------------------------- choice -> message


def stop_reason(choice: ParsedChoice, matched: str | None = None) -> str:
    if choice.finish_reason == "tool_calls":
        return "tool_use"
    if choice.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if matched else "end_turn"


def anthropic_usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def thinking_block(text: str, signer: Signer) -> dict[str, Any]:
    """A thinking block; its `signature` is an HMAC of the text (clients send it back
    unchanged; the gateway renders the text, so it needs no secret inside)."""
    return {"type": "thinking", "thinking": text, "signature": signer.sign(text)}


def content_blocks(choice: ParsedChoice, signer: Signer) -> list[dict[str, Any]]:
    """[thinking?, text?, tool_use...] of a finished choice (text also when nothing else
    was generated)."""
    blocks: list[dict[str, Any]] = []
    if choice.reasoning_content:
        blocks.append(thinking_block(choice.reasoning_content, signer))
    if choice.content or not (choice.tool_calls or blocks):
        blocks.append({"type": "text", "text": choice.content or ""})
    blocks.extend(
        {"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)}
        for c in choice.tool_calls
    )
    return blocks


def build_message(
    *,
    message_id: str,
    model: str,
    choice: ParsedChoice,
    usage: Usage,
    signer: Signer,
    matched: str | None = None,
) -> dict[str, Any]:
    """The non-streamed reply (`type: "message"`)."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(choice, signer),
        "stop_reason": stop_reason(choice, matched),
        "stop_sequence": matched,
        "usage": anthropic_usage(usage),
    }


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(error: OpenAIError) -> dict[str, Any]:
    """Anthropic's error shape for `error` (its OpenAI `code` kept alongside)."""
    kind = _ERROR_TYPES.get(
        error.status, "api_error" if error.status >= 500 else "invalid_request_error"
    )
    body: dict[str, Any] = {"type": kind, "message": error.message}
    if error.code:
        body["code"] = error.code
    return {"type": "error", "error": body}


# ---------------------------------------------------------------- streaming


class MessageStreamAssembler:
    """Anthropic SSE events (dicts with `type`) for one generated choice.

    `start()`: message_start, ping. Then per new tokens: a thinking block
    (thinking_delta, and a signature_delta before it closes), a text block (text_delta),
    and a tool_use block per call, as Anthropic streams one: content_block_start with the
    id, name and `input: {}` as soon as the name is known, `input_json_delta` fragments as
    the arguments are generated (`ChoiceStream`'s call fragments, the chat stream's: they
    concatenate to the call's arguments text), content_block_stop once the call closes.
    Formats whose calls stream whole send one fragment when the call closes. `finish`
    adds message_delta (stop_reason, usage); `stop()` is message_stop, sent once the
    record is durable. The message built from the events equals `build_message`'s,
    except where a call that started streaming turns out malformed or cut off: its
    block was shown (as a real server's would be), and the reply keeps its text."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        message_id: str,
        model: str,
        sampling: SamplingSpec,
        prompt_tokens: int,
        parse_tools: bool,
        signer: Signer,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self._stream = ChoiceStream(
            tokenizer,
            completion_id=message_id,
            parse_tools=parse_tools,
            stop=sampling.stop,
            tools=tools,
            call_fragments=True,
        )
        self._id = message_id
        self._model = model
        self._prompt_tokens = prompt_tokens
        self._signer = signer
        self._index = -1
        self._open: str | None = None  # "thinking" | "text" | "tool_use"
        self._thinking = ""
        self._call = -1
        """The call index of the open tool_use block."""
        self._done = 0
        """Calls completed so far (their blocks are stopped)."""
        self.message: dict[str, Any] | None = None
        """The final message (as `build_message` makes it), once finished."""

    @property
    def result(self) -> ParsedChoice | None:
        return self._stream.result

    def start(self) -> list[dict[str, Any]]:
        usage = {
            "input_tokens": self._prompt_tokens,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def push(self, new_ids: Sequence[int], finish: FinishReason | None) -> list[dict[str, Any]]:
        delta = self._stream.push(new_ids, [0.0] * len(new_ids), finish)
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            events += self._text("thinking", delta.reasoning)
        if not (delta.call_fragments or delta.tool_calls):  # the common step
            if delta.content:
                events += self._text("text", delta.content)
        else:
            events += self._calls(delta)
        if delta.finished is not None:
            events += self._finish(delta.finished, finish)
        return events

    def _calls(self, delta: StreamDelta) -> list[dict[str, Any]]:
        """Events of a step that carries call fragments or completes calls, in the order
        the text has them: the open call's arguments (and its stop, if it completed),
        then content (before any new call), then the new calls."""
        frags = delta.call_fragments
        done = self._done + len(delta.tool_calls)  # calls below this index are complete
        first_head = next((k for k, f in enumerate(frags) if f.head is not None), len(frags))
        events: list[dict[str, Any]] = []
        for frag in frags[:first_head]:
            events.append(self._arguments(frag.arguments))
        if self._open == "tool_use" and self._call < done:
            events += self._close()
        if delta.content:
            events += self._text("text", delta.content)
        for frag in frags[first_head:]:
            if frag.head is not None:
                events += self._close()
                self._open, self._call = "tool_use", frag.index
                events.append(
                    {
                        "type": "content_block_start",
                        "index": self._new_block(),
                        "content_block": {
                            "type": "tool_use",
                            "id": frag.head.id,
                            "name": frag.head.name,
                            "input": {},
                        },
                    }
                )
                continue
            text = frag.arguments
            if (
                self._done <= frag.index < done
                and delta.tool_calls[frag.index - self._done].arguments == text
                and json_object_or_none(text) is None
            ):
                # A call that came whole with arguments that are no JSON object (a
                # JSON-encoded string): sent wrapped, as `tool_input` makes its input.
                text = arguments_text(tool_input(text))
            events.append(self._arguments(text))
        if self._open == "tool_use" and self._call < done:
            events += self._close()
        self._done = done
        return events

    def _arguments(self, text: str) -> dict[str, Any]:
        return {
            "type": "content_block_delta",
            "index": self._index,
            "delta": {"type": "input_json_delta", "partial_json": text},
        }

    def _new_block(self) -> int:
        self._index += 1
        return self._index

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open != kind:
            events += self._close()
            self._open = kind
            index = self._new_block()
            block = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            events.append({"type": "content_block_start", "index": index, "content_block": block})
        if kind == "thinking":
            self._thinking += text
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "text_delta", "text": text}
        events.append({"type": "content_block_delta", "index": self._index, "delta": delta})
        return events

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        events: list[dict[str, Any]] = []
        if self._open == "thinking":
            events.append(
                {
                    "type": "content_block_delta",
                    "index": self._index,
                    "delta": {
                        "type": "signature_delta",
                        "signature": self._signer.sign(self._thinking),
                    },
                }
            )
        events.append({"type": "content_block_stop", "index": self._index})
        self._open = None
        return events

    def _finish(self, choice: ParsedChoice, finish: FinishReason | None) -> list[dict[str, Any]]:
        events = self._close()
        if self._index < 0:  # nothing generated: one empty text block, as build_message
            events += self._text("text", "")[:1] + self._close()
        matched = finish.matched if finish is not None and isinstance(finish.matched, str) else None
        usage = Usage.of(self._prompt_tokens, [choice])
        self.message = build_message(
            message_id=self._id,
            model=self._model,
            choice=choice,
            usage=usage,
            signer=self._signer,
            matched=matched,
        )
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": self.message["stop_reason"], "stop_sequence": matched},
                "usage": {"output_tokens": usage.completion_tokens},
            }
        )
        return events

    @staticmethod
    def stop() -> dict[str, Any]:
        return {"type": "message_stop"}
