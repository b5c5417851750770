"""Chat <-> token ids with the real tiny tokenizer and chat template: rendering, prefix
stability across turns, sampling resolution, completion bodies, streaming chunks."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from support.tokenizer_reference import hf

from areal_service.sglang_protocol import FinishReason
from gateway.protocol import ClientSampling
from gateway.translate import (
    ChatTokenizer,
    ContextLengthExceeded,
    GeneratedChoice,
    ParsedChoice,
    Usage,
    normalize_messages,
    parse_choice,
    render_prompt_ids,
    resolve_sampling,
)
from gateway.wires.chat.encode import ChatStreamAssembler, build_chat_completion, build_usage_chunk
from gateway.wires.chat.protocol import ChatCompletionRequest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    }
]
HISTORY = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "What is 2 + 3? 😀"},
]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
OUTPUTS = {
    "plain": "The answer is 5. 😀",
    "think": "<think>\nadd them 🤔\n</think>\n\nIt is 5.",
    "call": CALL,
    "content_and_two_calls": "Let me add.\n" + CALL + "\n" + CALL.replace("2", "7"),
    "think_and_call": "<think>\nuse the tool\n</think>\n\n" + CALL,
    "malformed_call": '<tool_call>\n{"name": add}\n</tool_call>',
}


def encode(tok: ChatTokenizer, text: str) -> list[int]:
    return hf().encode(text, add_special_tokens=False)


def eos(tok: ChatTokenizer) -> int:
    return hf().convert_tokens_to_ids("<|im_end|>")


def generated(tok: ChatTokenizer, text: str, *, finish: str = "eos") -> GeneratedChoice:
    ids = encode(tok, text)
    if finish == "eos":
        ids.append(eos(tok))
        reason = FinishReason("stop", eos(tok))
    else:
        reason = FinishReason("length")
    lps = tuple(-0.01 * (i + 1) for i in range(len(ids)))
    tops = tuple(((t, lp), (t + 1, lp - 1.0)) for t, lp in zip(ids, lps, strict=True))
    return GeneratedChoice(tuple(ids), lps, reason, tops)


def whole_encode(tok: ChatTokenizer, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    return encode(
        tok,
        hf().apply_chat_template(
            normalize_messages(messages), tools=tools, add_generation_prompt=True, tokenize=False
        ),
    )


# ---------------------------------------------------------------- rendering


def test_every_role_renders(tok: ChatTokenizer) -> None:
    messages = [
        {"role": "developer", "content": "Dev rules."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1,"b":2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "3"}]},
        {"role": "function", "name": "add", "content": "3 again"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "checked"},
        {"role": "system", "content": "Late system note."},
        {"role": "user", "content": "thanks"},
    ]
    text = hf().decode(render_prompt_ids(tok, messages, TOOLS, "auto"))
    assert text.startswith("<|im_start|>system\nDev rules.\n\n# Tools")
    assert '"name": "add"' in text
    assert "<|im_start|>user\npart one\npart two<|im_end|>" in text
    # arguments string rendered verbatim (odd spacing preserved)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1,"b":2}}' in text
    )
    assert (
        "<tool_response>\n3\n</tool_response>\n<tool_response>\n3 again\n</tool_response>" in text
    )
    assert "<|im_start|>assistant\n<think>\nchecked\n</think>\n\nDone.<|im_end|>" in text
    assert "<|im_start|>system\nLate system note.<|im_end|>" in text
    assert text.endswith("<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n")


def test_developer_renders_as_system_and_parts_as_text(tok: ChatTokenizer) -> None:
    a = render_prompt_ids(
        tok,
        [
            {"role": "developer", "content": "x"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        None,
        None,
    )
    b = render_prompt_ids(
        tok, [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}], None, None
    )
    assert a == b


def test_legacy_function_call_message(tok: ChatTokenizer) -> None:
    msg = {
        "role": "assistant",
        "content": None,
        "function_call": {"name": "add", "arguments": '{"a": 1}'},
    }
    text = hf().decode(render_prompt_ids(tok, [*HISTORY, msg], TOOLS, None))
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in text


def test_request_model_messages_render(tok: ChatTokenizer) -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                *HISTORY,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "add", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "5"},
            ],
            "tools": TOOLS,
            "store": False,
            "unknown_field": {"x": 1},
        }
    )
    ids = render_prompt_ids(tok, req.message_dicts(), req.chat_tools(), req.chat_tool_choice())
    assert ids == whole_encode(tok, req.message_dicts(), TOOLS)


def test_tool_choice_none_drops_tools_required_keeps_them(tok: ChatTokenizer) -> None:
    none = hf().decode(render_prompt_ids(tok, HISTORY, TOOLS, "none"))
    required = hf().decode(render_prompt_ids(tok, HISTORY, TOOLS, "required"))
    named = hf().decode(
        render_prompt_ids(tok, HISTORY, TOOLS, {"type": "function", "function": {"name": "add"}})
    )
    assert "# Tools" not in none
    assert "# Tools" in required and required == named


def test_segment_cache_equals_whole_prompt_encoding(tok: ChatTokenizer) -> None:
    assert tok._split_at == "<|im_start|>"  # the probe accepted this tokenizer
    conversations = [
        HISTORY,
        [
            *HISTORY,
            {"role": "assistant", "content": "  spaced \n\n"},
            {"role": "user", "content": "\n<|im_start|> literal marker and 🤔"},
        ],
        [{"role": "user", "content": ""}],
    ]
    for messages in conversations:
        for tools in (None, TOOLS):
            first = render_prompt_ids(tok, messages, tools, None)
            again = render_prompt_ids(tok, messages, tools, None)  # from the cache
            assert first == again == whole_encode(tok, messages, tools)


def test_decode_matches_transformers_and_drops_special_tokens(tok: ChatTokenizer) -> None:
    ids = encode(tok, OUTPUTS["think_and_call"] + "<|im_end|>") + encode(tok, "é😀")[:-1]
    assert tok.decode(ids) == hf().decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in tok.decode(ids) and "<tool_call>" in tok.decode(ids)


def test_no_double_bos_and_generation_prompt(tok: ChatTokenizer) -> None:
    ids = render_prompt_ids(tok, HISTORY, None, None)
    assert ids[0] == hf().convert_tokens_to_ids("<|im_start|>")
    assert hf().decode(ids).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("finish", ["eos", "length"])
def test_next_turn_prompt_extends_prompt_plus_output(
    tok: ChatTokenizer, name: str, finish: str
) -> None:
    """The parent's prompt ids + output ids (with <|im_end|>) prefix the child's prompt
    when the assistant message is the one build_chat_completion returned."""
    prompt = render_prompt_ids(tok, HISTORY, TOOLS, "auto")
    choice = generated(tok, OUTPUTS[name], finish=finish)
    parsed = parse_choice(tok, choice, completion_id="chatcmpl-p", parse_tools=True)
    body = build_chat_completion(
        completion_id="chatcmpl-p",
        model="m",
        created=1,
        choices=[parsed],
        usage=Usage.of(len(prompt), [parsed]),
    )
    message = ChatCompletion.model_validate(body).choices[0].message.model_dump(exclude_none=True)
    history = [*HISTORY, message]
    history += [
        {"role": "tool", "tool_call_id": c["id"], "content": "5"}
        for c in message.get("tool_calls", [])
    ] or [{"role": "user", "content": "ok"}]
    child = render_prompt_ids(tok, history, TOOLS, "auto")
    parent = prompt + list(choice.output_ids)
    if finish == "length":
        parent.append(eos(tok))  # re-rendered history closes the turn
    assert child[: len(parent)] == parent


# ---------------------------------------------------------------- sampling


def test_context_length_exceeded() -> None:
    with pytest.raises(ContextLengthExceeded) as info:
        resolve_sampling(
            ClientSampling(),
            prompt_tokens=100,
            context_length=100,
            default_max_tokens=16,
            mode="client",
        )
    err = info.value
    assert (err.prompt_tokens, err.limit, err.code, err.param) == (
        100,
        100,
        "context_length_exceeded",
        "messages",
    )
    assert "maximum context length is 100 tokens" in err.message
    assert "resulted in 100 tokens" in err.message


def test_max_tokens_clamped_and_defaulted() -> None:
    spec = resolve_sampling(
        ClientSampling(max_tokens=500),
        prompt_tokens=90,
        context_length=100,
        default_max_tokens=16,
        mode="client",
    )
    assert spec.max_new_tokens == 10
    spec = resolve_sampling(
        ClientSampling(), prompt_tokens=10, context_length=100, default_max_tokens=16, mode="client"
    )
    assert spec.max_new_tokens == 16


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    req = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=50,
        max_completion_tokens=7,
        stop="END",
    )
    spec = resolve_sampling(
        req.client_sampling(),
        prompt_tokens=5,
        context_length=100,
        default_max_tokens=16,
        mode="client",
    )
    assert spec.max_new_tokens == 7
    assert spec.stop == ("END",)


def test_vllm_length_extensions_reach_the_engine_in_both_modes() -> None:
    """`min_tokens` and `ignore_eos` (vLLM's chat extensions) decide where an output ends;
    a client moving from vLLM's own endpoint keeps its lengths, training or not."""
    req = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=12,
        min_tokens=30,
        ignore_eos=True,
    )
    for mode in ("client", "training"):
        spec = resolve_sampling(
            req.client_sampling(),
            prompt_tokens=5,
            context_length=100,
            default_max_tokens=16,
            mode=mode,
        )
        params = spec.to_sampling_params()
        assert params["ignore_eos"] is True
        assert params["min_new_tokens"] == 12  # never above the length limit
    plain = resolve_sampling(
        ClientSampling(), prompt_tokens=5, context_length=100, default_max_tokens=16, mode="client"
    ).to_sampling_params()
    assert "ignore_eos" not in plain and "min_new_tokens" not in plain


def test_client_mode_honours_client_values() -> None:
    client = ClientSampling(
        temperature=0.0, top_p=0.5, top_k=20, seed=7, stop=("\n",), n=3, presence_penalty=0.5
    )
    spec = resolve_sampling(
        client, prompt_tokens=5, context_length=100, default_max_tokens=16, mode="client"
    )
    assert (spec.temperature, spec.top_p, spec.top_k, spec.n) == (0.0, 0.5, 20, 3)
    params = spec.to_sampling_params(choice_index=2)
    assert params == {
        "max_new_tokens": 16,
        "temperature": 0.0,
        "top_p": 0.5,
        "top_k": 20,
        "stop": ["\n"],
        "sampling_seed": 9,
        "presence_penalty": 0.5,
    }
    default = resolve_sampling(
        ClientSampling(), prompt_tokens=5, context_length=100, default_max_tokens=16, mode="client"
    )
    assert (default.temperature, default.top_p, default.top_k) == (1.0, 1.0, -1)


def test_training_mode_forces_training_values() -> None:
    client = ClientSampling(temperature=0.0, top_p=0.3, top_k=5, stop=("X",), frequency_penalty=1.0)
    spec = resolve_sampling(
        client,
        prompt_tokens=5,
        context_length=100,
        default_max_tokens=16,
        mode="training",
        training_temperature=0.8,
    )
    assert spec.to_sampling_params() == {
        "max_new_tokens": 16,
        "temperature": 0.8,
        "top_p": 1.0,
        "top_k": -1,
        "stop": ["X"],
    }
    assert spec.mode == "training"


# ---------------------------------------------------------------- completion bodies


def test_chat_completion_body_validates(tok: ChatTokenizer) -> None:
    choice = generated(tok, OUTPUTS["think_and_call"])
    parsed = parse_choice(tok, choice, completion_id="chatcmpl-a", parse_tools=True)
    body = build_chat_completion(
        completion_id="chatcmpl-a",
        model="alias",
        created=123,
        choices=[parsed],
        usage=Usage.of(40, [parsed], 8),
    )
    cc = ChatCompletion.model_validate(body)
    assert cc.id == "chatcmpl-a" and cc.model == "alias" and cc.object == "chat.completion"
    c = cc.choices[0]
    assert c.finish_reason == "tool_calls" and c.logprobs is None
    assert c.message.content is None
    assert body["choices"][0]["message"]["reasoning_content"] == "use the tool"
    call = c.message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert cc.usage.completion_tokens == len(choice.output_ids)
    assert cc.usage.total_tokens == 40 + len(choice.output_ids)
    assert cc.usage.prompt_tokens_details.cached_tokens == 8
    think_close = hf().convert_tokens_to_ids("</think>")
    assert (
        cc.usage.completion_tokens_details.reasoning_tokens
        == choice.output_ids.index(think_close) + 1
    )


def test_plain_reply_strips_eos_and_stop_string(tok: ChatTokenizer) -> None:
    parsed = parse_choice(tok, generated(tok, "Hi there"), completion_id="c", parse_tools=False)
    assert (parsed.content, parsed.finish_reason) == ("Hi there", "stop")
    ids = tuple(encode(tok, "Thought: go\nObservation: 5"))
    stopped = GeneratedChoice(ids, (0.0,) * len(ids), FinishReason("stop", "Observation:"))
    parsed = parse_choice(tok, stopped, completion_id="c", parse_tools=False)
    assert parsed.content == "Thought: go\n"


@pytest.mark.parametrize("kind,expected", [("length", "length"), ("abort", "length")])
def test_cut_off_finish_reasons(tok: ChatTokenizer, kind: str, expected: str) -> None:
    ids = tuple(encode(tok, "partial answ"))
    choice = GeneratedChoice(ids, (0.0,) * len(ids), FinishReason(kind))  # type: ignore[arg-type]
    assert parse_choice(tok, choice, completion_id="c", parse_tools=True).finish_reason == expected


def test_logprobs_shape_and_bytes(tok: ChatTokenizer) -> None:
    choice = generated(tok, OUTPUTS["plain"])
    parsed = parse_choice(tok, choice, completion_id="c", parse_tools=False, logprobs=2)
    body = build_chat_completion(
        completion_id="c", model="m", created=1, choices=[parsed], usage=Usage.of(3, [parsed])
    )
    lp = body["choices"][0]["logprobs"]
    assert lp["refusal"] is None
    assert set(lp["content"][0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert len(lp["content"]) == len(choice.output_ids) - 1  # the EOS is not content
    assert len(lp["content"][0]["top_logprobs"]) == 2
    assert bytes(b for e in lp["content"] for b in e["bytes"]).decode() == OUTPUTS["plain"]
    assert ChatCompletion.model_validate(body).choices[0].logprobs.content[1].logprob == -0.02
    none = parse_choice(tok, choice, completion_id="c", parse_tools=False, logprobs=0)
    assert all(e.top == () for e in none.logprobs)


def test_several_choices(tok: ChatTokenizer) -> None:
    parsed = [
        parse_choice(tok, generated(tok, OUTPUTS[k]), completion_id="c", index=i, parse_tools=True)
        for i, k in enumerate(["call", "call", "plain"])
    ]
    body = build_chat_completion(
        completion_id="c", model="m", created=1, choices=parsed, usage=Usage.of(10, parsed)
    )
    cc = ChatCompletion.model_validate(body)
    assert [c.index for c in cc.choices] == [0, 1, 2]
    assert [c.finish_reason for c in cc.choices] == ["tool_calls", "tool_calls", "stop"]
    assert cc.choices[0].message.tool_calls[0].id != cc.choices[1].message.tool_calls[0].id
    assert cc.usage.completion_tokens == sum(p.completion_tokens for p in parsed)


# ---------------------------------------------------------------- streaming


def stream(
    tok: ChatTokenizer,
    choice: GeneratedChoice,
    *,
    step: int = 1,
    parse_tools: bool,
    logprobs: int | None = None,
    stop: tuple[str, ...] = (),
    deltas: bool = False,
) -> tuple[list[dict[str, Any]], ParsedChoice | None]:
    """Feed `choice` to an assembler `step` tokens at a time, as cumulative outputs
    (SGLang's stream) or as new-token deltas (the backend client's stream)."""
    asm = ChatStreamAssembler(
        tok,
        completion_id="chatcmpl-s",
        model="m",
        created=5,
        parse_tools=parse_tools,
        logprobs=logprobs,
        stop=stop,
    )
    chunks: list[dict[str, Any]] = []
    n = len(choice.output_ids)
    start = 0
    for end in [*range(step, n, step), n]:
        finish = choice.finish if end == n else None
        if deltas:
            chunks += asm.push(
                choice.output_ids[start:end],
                choice.output_logprobs[start:end],
                finish,
                new_top=choice.top_logprobs[start:end],
            )
        else:
            chunks += asm.update(
                GeneratedChoice(
                    choice.output_ids[:end],
                    choice.output_logprobs[:end],
                    finish,
                    choice.top_logprobs[:end],
                )
            )
        start = end
    return chunks, asm.result


def accumulate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client rebuilds from the deltas (openai-python / Agents SDK style)."""
    msg: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": {}}
    logprobs: list[dict[str, Any]] = []
    finish = None
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
        choice = chunk["choices"][0]
        delta = choice["delta"]
        msg["content"] += delta.get("content") or ""
        msg["reasoning_content"] += delta.get("reasoning_content") or ""
        for tc in delta.get("tool_calls") or ():
            slot = msg["tool_calls"].setdefault(tc["index"], {"arguments": ""})
            if "id" in tc:
                slot.update(id=tc["id"], name=tc["function"]["name"])
            slot["arguments"] += tc["function"].get("arguments") or ""
        if choice["logprobs"]:
            logprobs += choice["logprobs"]["content"]
        finish = choice["finish_reason"] or finish
    return {**msg, "logprobs": logprobs, "finish_reason": finish}


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("step,deltas", [(1, False), (3, False), (2, True)])
def test_stream_adds_up_to_the_non_streaming_message(
    tok: ChatTokenizer, name: str, step: int, deltas: bool
) -> None:
    choice = generated(tok, OUTPUTS[name])
    expected = parse_choice(tok, choice, completion_id="chatcmpl-s", parse_tools=True, logprobs=2)
    chunks, result = stream(tok, choice, step=step, parse_tools=True, logprobs=2, deltas=deltas)
    assert result == expected
    got = accumulate(chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert got["finish_reason"] == expected.finish_reason
    assert sum(c["choices"][0]["finish_reason"] is not None for c in chunks) == 1
    assert got["content"] == (expected.content or "")
    assert got["reasoning_content"] == (expected.reasoning_content or "")
    assert [(t["id"], t["name"], t["arguments"]) for t in got["tool_calls"].values()] == [
        (c.id, c.name, c.arguments) for c in expected.tool_calls
    ]
    assert got["logprobs"] == [t.to_openai() for t in expected.logprobs]
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        for text in (delta.get("content"), delta.get("reasoning_content")):
            assert text is None or "\ufffd" not in text
            if name != "malformed_call":  # a malformed block is content, markers and all
                assert text is None or ("<tool" not in text and "think>" not in text)


def test_emoji_split_over_byte_tokens_is_never_emitted_half(tok: ChatTokenizer) -> None:
    text = "🤔😀 ok 🎉"
    ids = encode(tok, text)
    assert len(ids) > len(text)  # emoji are several byte-level tokens each
    choice = generated(tok, text)
    chunks, result = stream(tok, choice, parse_tools=False)
    pieces = [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]]
    assert "".join(p for p in pieces if p) == text == result.content
    assert all("\ufffd" not in p for p in pieces if p)


def test_stream_holds_back_a_possible_stop_string(tok: ChatTokenizer) -> None:
    ids = tuple(encode(tok, "Thought: go\nObservation: 5"))
    choice = GeneratedChoice(ids, (0.0,) * len(ids), FinishReason("stop", "Observation:"))
    chunks, result = stream(tok, choice, parse_tools=False, stop=("Observation:",))
    pieces = [c["choices"][0]["delta"].get("content") or "" for c in chunks]
    assert "".join(pieces) == "Thought: go\n" == result.content
    assert not any("Obs" in p for p in pieces)


def test_stream_without_logprobs_sends_no_empty_chunks(tok: ChatTokenizer) -> None:
    chunks, _ = stream(tok, generated(tok, OUTPUTS["call"]), parse_tools=True)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert all(d for d in deltas[:-1])
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)
    first, args = deltas[1]["tool_calls"][0], deltas[2]["tool_calls"][0]
    assert set(first) == {"index", "id", "type", "function"} and first["type"] == "function"
    assert set(args) == {"index", "function"} and args["function"]["arguments"]


def test_usage_chunk(tok: ChatTokenizer) -> None:
    chunk = build_usage_chunk(completion_id="c", model="m", created=1, usage=Usage(10, 5, 2, 1))
    parsed = ChatCompletionChunk.model_validate(chunk)
    assert parsed.choices == [] and parsed.usage.total_tokens == 15
    assert parsed.usage.prompt_tokens_details.cached_tokens == 2
