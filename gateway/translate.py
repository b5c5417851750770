"""Chat Completions <-> token ids (no HTTP, no store): messages + tools -> prompt ids via
the chat template; sampling params for SGLang `/generate`; generated ids -> the parsed
choice (the wires' neutral reply). Generated ids are decoded, never re-encoded, and the
parsed reply re-renders to the same text, so prompt + output ids prefix the next turn's
prompt. The streamed reply (`gateway/wires/choice_stream.py`) builds its last delta with this
module's `finish_choice`, so streamed and whole replies agree.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from areal_service.sglang_protocol import FinishReason
from gateway.protocol import TEXT_PART_TYPES, ClientSampling, InvalidRequestError, ToolChoice
from gateway.tokenizer import ChatTokenizer
from gateway.toolparse import ParsedText, ToolCall

log = logging.getLogger(__name__)

SamplingMode = Literal["client", "training"]


# ---------------------------------------------------------------- prompt rendering


def tools_enabled(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: ToolChoice | None
) -> bool:
    """Tools are rendered and tool calls parsed unless none were offered or
    `tool_choice` is "none"."""
    return bool(tools) and tool_choice != "none"


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages in the form the chat template renders: developer -> system, legacy
    function -> tool, content parts -> text, no content (None or absent: an assistant turn
    with only tool calls) -> "", assistant `tool_calls` with arguments kept as the original
    JSON string (rendered verbatim, so history re-renders what the model produced), legacy
    `function_call` -> one tool call.

    "" and not None, as vLLM renders it: transformers drops None-valued keys before
    rendering, and a template that reads `message['content']` unguarded (SmolLM2's,
    DeepSeek's) then fails on an undefined field; templates that test it (`if
    message.content`, `is none`/`is string`) render "" as they render no content."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = {"developer": "system", "function": "tool"}.get(m["role"], m["role"])
        content = _content_text(m.get("content"))
        msg: dict[str, Any] = {"role": role, "content": "" if content is None else content}
        if role == "assistant":
            calls = m.get("tool_calls") or (
                [{"id": "call_legacy", "function": m["function_call"]}]
                if m.get("function_call")
                else []
            )
            if calls:
                msg["tool_calls"] = [_tool_call_for_template(c) for c in calls]
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                msg["reasoning_content"] = reasoning
        elif role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    msg[key] = m[key]
        out.append(msg)
    return out


def _content_text(content: str | Sequence[Mapping[str, Any]] | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if p.get("type") in TEXT_PART_TYPES)


def _tool_call_for_template(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")},
    }


def render_prompt_ids(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: ToolChoice | None,
) -> list[int]:
    """Prompt ids for a chat request: template (with the generation prompt) -> text ->
    ids without added special tokens.

    `tool_choice` "none" renders without tools. "required" or a named function cannot be
    enforced (decoding is not constrained): the tools are rendered and the model decides.
    """
    use_tools = tools_enabled(tools, tool_choice)
    if use_tools and tool_choice not in (None, "auto"):
        log.debug("tool_choice %r is not enforced; tools rendered, model decides", tool_choice)
    text = tokenizer.render(
        normalize_messages(messages), [dict(t) for t in tools or ()] if use_tools else None
    )
    return tokenizer.encode(checked_text(text))


def checked_text(text: str) -> str:
    """`text`, or 400 for text the tokenizer cannot take (a lone surrogate)."""
    if not text.isascii():
        try:
            text.encode()  # O(text) in C; the tokenizer raises TypeError on a lone surrogate
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(
                f"the request contains invalid Unicode ({exc.reason} at character "
                f"{exc.start} of the rendered prompt); send valid UTF-8 text"
            ) from exc
    return text


# ---------------------------------------------------------------- sampling


class ContextLengthExceeded(InvalidRequestError):
    """The prompt alone fills the context: 400 `context_length_exceeded`."""

    def __init__(self, prompt_tokens: int, limit: int, *, param: str = "messages") -> None:
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, your messages "
            f"resulted in {prompt_tokens} tokens. Please reduce the length of the messages.",
            param=param,
            code="context_length_exceeded",
        )
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class _SharedSampling(TypedDict):
    """The `SamplingSpec` fields both modes take alike (a plain dict at run time)."""

    max_new_tokens: int
    seed: int | None
    stop: tuple[str, ...]
    n: int
    mode: SamplingMode
    min_new_tokens: int
    ignore_eos: bool


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """Sampling actually used for one request (recorded with the completion: the trainer
    recomputes logprobs at the same temperature)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    n: int
    mode: SamplingMode
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs: SGLang's `logit_bias` ({"id": bias})."""
    min_new_tokens: int = 0
    ignore_eos: bool = False

    def to_sampling_params(self, choice_index: int = 0) -> dict[str, Any]:
        """SGLang `/generate` `sampling_params` for one choice. `n` is not sent: the
        gateway fans out one request per choice (each resumable alone after an abort),
        and choice i samples with seed + i so seeded choices differ."""
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        if self.seed is not None:
            params["sampling_seed"] = self.seed + choice_index
        if self.frequency_penalty:
            params["frequency_penalty"] = self.frequency_penalty
        if self.presence_penalty:
            params["presence_penalty"] = self.presence_penalty
        if self.logit_bias:
            params["logit_bias"] = {str(token): bias for token, bias in self.logit_bias}
        if self.min_new_tokens:
            params["min_new_tokens"] = min(self.min_new_tokens, self.max_new_tokens)
        if self.ignore_eos:
            params["ignore_eos"] = True
        return params


def resolve_sampling(
    client: ClientSampling,
    *,
    prompt_tokens: int,
    context_length: int,
    default_max_tokens: int,
    mode: SamplingMode,
    training_temperature: float = 1.0,
    param: str = "messages",
    refuse_over_budget: bool = False,
    max_n_tokens: int | None = None,
) -> SamplingSpec:
    """Fit the output budget to the context (and `n` x it to `max_n_tokens`) and pick
    temperature/top_p/top_k.

    A client's `max_tokens` that does not fit beside the prompt is refused with 400
    `context_length_exceeded` when `refuse_over_budget` (OpenAI's chat API, and vLLM and
    SGLang behind it, answer so), else cut to what fits (the Anthropic route: Claude
    Code asks for 32000 whatever the model). The gateway's own default is always cut.

    `client`: honour the client (OpenAI defaults: temperature 1, top_p 1; top_p 0 means
    greedy). `training`: temperature = `training_temperature`, top_p 1, top_k -1, no
    penalties and no logit_bias, so behaviour logprobs match the trainer's. Stop, seed, length,
    `min_tokens` and `ignore_eos` are honoured in both modes (agents depend on stop
    strings; the last two change where an output ends, not its token distribution).
    """
    if prompt_tokens >= context_length:
        raise ContextLengthExceeded(prompt_tokens, context_length, param=param)
    asked = client.max_tokens
    if refuse_over_budget and asked is not None and prompt_tokens + asked > context_length:
        raise InvalidRequestError(
            f"This model's maximum context length is {context_length} tokens. However, you "
            f"requested {prompt_tokens + asked} tokens ({prompt_tokens} in the {param}, "
            f"{asked} in the completion). Please reduce the length of the {param} or "
            "completion.",
            param=param,
            code="context_length_exceeded",
        )
    max_new = min(asked or default_max_tokens, context_length - prompt_tokens)
    if max_n_tokens is not None and client.n * max_new > max_n_tokens:
        # One request may not ask the engine for more than this over all its choices (a
        # fair share; `gateway.limits.max_n_tokens`): refused when the client named max_tokens,
        # the default budget shrunk to fit when it did not.
        if asked is not None:
            raise InvalidRequestError(
                f"n * max_tokens = {client.n} * {max_new} = {client.n * max_new:,} completion "
                f"tokens; this gateway allows at most {max_n_tokens:,} per request (fewer "
                "choices or a smaller max_tokens)",
                param="max_tokens",
                code="too_many_tokens_requested",
            )
        max_new = max(1, max_n_tokens // client.n)
    common: _SharedSampling = {
        "max_new_tokens": max_new,
        "seed": client.seed,
        "stop": client.stop,
        "n": client.n,
        "mode": mode,
        "min_new_tokens": client.min_tokens,
        "ignore_eos": client.ignore_eos,
    }
    if mode == "training":
        return SamplingSpec(temperature=training_temperature, top_p=1.0, top_k=-1, **common)
    temperature = 1.0 if client.temperature is None else client.temperature
    top_p = 1.0 if client.top_p is None else client.top_p
    if top_p == 0:
        temperature, top_p = 0.0, 1.0
    return SamplingSpec(
        temperature=temperature,
        top_p=top_p,
        top_k=client.top_k or -1,
        frequency_penalty=client.frequency_penalty or 0.0,
        presence_penalty=client.presence_penalty or 0.0,
        logit_bias=client.logit_bias,
        **common,
    )


# ---------------------------------------------------------------- generated output


@dataclass(frozen=True, slots=True)
class GeneratedChoice:
    """One choice's output as far as generated: cumulative while streaming, complete
    when `finish` is set. Ids include the final EOS / stop token, as SGLang returns."""

    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...] = ()
    finish: FinishReason | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    """Per position: (token id, logprob) alternatives, when requested."""
    cached_tokens: int = 0

    def visible_len(self) -> int:
        """Ids that make the reply: all but a final matched stop token."""
        return visible_len(self.output_ids, self.finish)


def visible_len(ids: Sequence[int], finish: FinishReason | None) -> int:
    """Output positions the reply shows: all but a matched stop token at the end."""
    drop = (
        finish is not None
        and finish.type == "stop"
        and isinstance(finish.matched, int)
        and bool(ids)
        and ids[-1] == finish.matched
    )
    return len(ids) - drop


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[tuple[str, float, tuple[int, ...]], ...] = ()

    def to_openai(self) -> dict[str, Any]:
        """`{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`."""
        return {
            "token": self.token,
            "logprob": self.logprob,
            "bytes": list(self.bytes),
            "top_logprobs": [
                {"token": t, "logprob": lp, "bytes": list(b)} for t, lp, b in self.top
            ],
        }


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def of(
        cls, prompt_tokens: int, choices: Sequence[ParsedChoice], cached_tokens: int = 0
    ) -> Usage:
        """Usage of a request: completion tokens summed over its choices."""
        return cls(
            prompt_tokens,
            sum(c.completion_tokens for c in choices),
            cached_tokens,
            sum(c.reasoning_tokens for c in choices),
        )

    def to_chat(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }


@dataclass(frozen=True, slots=True)
class ParsedChoice:
    """A finished choice as the client sees it (both wire APIs build from this)."""

    index: int
    text: str
    """Decoded reply (markers kept, stop token / stop string trimmed)."""
    content: str | None
    reasoning_content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: Literal["stop", "length", "tool_calls"]
    completion_tokens: int
    reasoning_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None
    """None unless the client asked for logprobs."""

    def to_message(self) -> dict[str, Any]:
        """The assistant message; replayed as history it re-renders `text`."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg

    def to_openai(self) -> dict[str, Any]:
        """`choices[i]` of a `chat.completion`."""
        logprobs = (
            None
            if self.logprobs is None
            else {"content": [t.to_openai() for t in self.logprobs], "refusal": None}
        )
        return {
            "index": self.index,
            "message": self.to_message(),
            "finish_reason": self.finish_reason,
            "logprobs": logprobs,
        }


def finish_reason_for(
    finish: FinishReason | None, has_tool_calls: bool
) -> Literal["stop", "length", "tool_calls"]:
    """OpenAI finish reason: `tool_calls` whenever calls were parsed (even if cut off
    after them), `length` for a length stop or a final abort, else `stop`."""
    if has_tool_calls:
        return "tool_calls"
    return "length" if finish is not None and finish.type in ("length", "abort") else "stop"


def id_seed(completion_id: str, index: int) -> str:
    """Seed of tool-call ids of choice `index` (the same streamed or not)."""
    return f"{completion_id}:{index}"


def trim_stop(text: str, finish: FinishReason | None) -> str:
    """`text` cut before the stop string the backend matched (it is not shown)."""
    if finish is not None and isinstance(finish.matched, str):
        cut = text.find(finish.matched)
        if cut >= 0:
            return text[:cut]
    return text


def token_logprobs(
    tokenizer: ChatTokenizer, choice: GeneratedChoice, start: int, end: int, top_n: int
) -> tuple[TokenLogprob, ...]:
    """OpenAI logprob entries of output positions [start, end)."""
    out = []
    for pos in range(start, min(end, len(choice.output_logprobs))):
        token, raw = tokenizer.token_info(choice.output_ids[pos])
        alts = choice.top_logprobs[pos] if pos < len(choice.top_logprobs) and top_n else ()
        top = tuple(
            (t, lp, b)
            for (t, b), lp in ((tokenizer.token_info(tid), lp) for tid, lp in alts[:top_n])
        )
        out.append(TokenLogprob(token, choice.output_logprobs[pos], raw, top))
    return tuple(out)


def finish_choice(
    tokenizer: ChatTokenizer,
    choice: GeneratedChoice,
    parsed: ParsedText,
    text: str,
    *,
    index: int,
    logprobs: tuple[TokenLogprob, ...] | None,
) -> ParsedChoice:
    """The one place a ParsedChoice is made, streaming or not, so both agree."""
    visible = choice.output_ids[: choice.visible_len()]
    reasoning_tokens = 0
    if parsed.reasoning is not None:
        close = tokenizer.think_close_id
        reasoning_tokens = visible.index(close) + 1 if close in visible else len(visible)
    content: str | None = parsed.content
    if parsed.tool_calls and not content:
        content = None
    return ParsedChoice(
        index=index,
        text=text,
        content=content,
        reasoning_content=parsed.reasoning,
        tool_calls=parsed.tool_calls,
        finish_reason=finish_reason_for(choice.finish, bool(parsed.tool_calls)),
        completion_tokens=len(choice.output_ids),
        reasoning_tokens=reasoning_tokens,
        logprobs=logprobs,
    )


def parse_choice(
    tokenizer: ChatTokenizer,
    choice: GeneratedChoice,
    *,
    completion_id: str,
    index: int = 0,
    parse_tools: bool,
    logprobs: int | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> ParsedChoice:
    """A finished generation -> the client's view, parsed by the model's output parser.
    `logprobs`: None (not requested) or the number of top alternatives per token;
    `tools`: the request's tool definitions (argument types, for formats that need them)."""
    end = choice.visible_len()
    text = trim_stop(tokenizer.decode(choice.output_ids[:end]), choice.finish)
    parsed = tokenizer.output_parser.parse(
        text,
        parse_tools=parse_tools,
        id_seed=id_seed(completion_id, index),
        final=True,
        tools=tools,
    )
    lps = None if logprobs is None else token_logprobs(tokenizer, choice, 0, end, logprobs)
    return finish_choice(tokenizer, choice, parsed, text, index=index, logprobs=lps)
