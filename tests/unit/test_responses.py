"""Responses API <-> chat: input items on the exact wire shapes clients send, response
bodies and stream events validated against openai-python's types."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError
from support.tokenizer_reference import hf

from areal_service.sglang_protocol import FinishReason
from gateway.protocol import InvalidRequestError
from gateway.translate import (
    ChatTokenizer,
    GeneratedChoice,
    SamplingSpec,
    Usage,
    parse_choice,
    render_prompt_ids,
    resolve_sampling,
)
from gateway.wires.responses.encode import ResponsesStreamAssembler, build_response
from gateway.wires.responses.protocol import ResponsesRequest
from gateway.wires.responses.translate import chat_tool_choice, responses_to_chat

EVENTS = TypeAdapter(ResponseStreamEvent)
TOOL = {
    "type": "function",
    "name": "add",
    "description": "Add two numbers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "strict": True,
}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
# Agents SDK 0.24 over Responses, turn 2 (contract §8): the function_call item comes back
# with its id and status, then the output.
AGENTS_TURN_2 = {
    "model": "areal-policy",
    "instructions": "You add numbers.",
    "include": [],
    "tools": [TOOL],
    "input": [
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "arguments": '{"a":2,"b":3}',
            "call_id": "call_abc",
            "name": "add",
            "type": "function_call",
            "id": "fc_123",
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "call_abc", "output": "5.0"},
    ],
}


def generated(tok: ChatTokenizer, text: str, eos: bool = True) -> GeneratedChoice:
    ids = hf().encode(text, add_special_tokens=False)
    end = hf().convert_tokens_to_ids("<|im_end|>")
    finish = FinishReason("stop", end) if eos else FinishReason("length")
    ids += [end] if eos else []
    return GeneratedChoice(tuple(ids), tuple(-0.1 for _ in ids), finish, cached_tokens=3)


def spec() -> SamplingSpec:
    return SamplingSpec(
        max_new_tokens=64,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        seed=None,
        stop=(),
        n=1,
        mode="training",
    )


# ---------------------------------------------------------------- input conversion


def test_agents_sdk_turn_two_wire_shape() -> None:
    messages, tools, choice = responses_to_chat(ResponsesRequest.model_validate(AGENTS_TURN_2))
    assert messages == [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a":2,"b":3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "5.0"},
    ]
    assert tools == [
        {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
    ]
    assert list(tools[0]["function"]) == ["name", "description", "parameters", "strict"]
    assert choice is None


def test_string_input_and_roles() -> None:
    messages, tools, _ = responses_to_chat(ResponsesRequest(model="m", input="hi"))
    assert messages == [{"role": "user", "content": "hi"}] and tools is None
    messages, _, _ = responses_to_chat(
        ResponsesRequest(
            model="m",
            input=[
                {"role": "developer", "content": "dev"},
                {
                    "type": "message",
                    "role": "system",
                    "content": [{"type": "input_text", "text": "s"}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "a"},
                        {"type": "input_text", "text": "b"},
                    ],
                },
                {
                    "type": "message",
                    "id": "msg_1",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "reply", "annotations": []}],
                },
            ],
        )
    )
    assert messages == [
        {"role": "system", "content": "dev"},
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "reply"},
    ]


def test_reasoning_message_and_calls_merge_into_one_assistant_message() -> None:
    messages, _, _ = responses_to_chat(
        ResponsesRequest(
            model="m",
            input=[
                {"role": "user", "content": "go"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "think"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Calling.", "annotations": []}],
                },
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a":1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "1"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "2"}],
                },
                {"type": "function_call", "call_id": "c3", "name": "add", "arguments": "{}"},
            ],
        )
    )
    assert messages[1] == {
        "role": "assistant",
        "content": "Calling.",
        "reasoning_content": "think",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}},
        ],
    }
    assert messages[2:4] == [
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
    ]
    assert messages[4]["tool_calls"][0]["id"] == "c3" and messages[4]["content"] is None
    assert len(messages) == 5


def test_summary_only_reasoning_item() -> None:
    messages, _, _ = responses_to_chat(
        ResponsesRequest(
            model="m",
            input=[
                {
                    "type": "reasoning",
                    "id": "rs",
                    "summary": [{"type": "summary_text", "text": "s"}],
                },
                {"role": "assistant", "content": "a"},
            ],
        )
    )
    assert messages == [{"role": "assistant", "content": "a", "reasoning_content": "s"}]


@pytest.mark.parametrize(
    "item,param",
    [
        ({"type": "item_reference", "id": "x"}, "input[0]"),
        (
            {"role": "user", "content": [{"type": "input_image", "image_url": "u"}]},
            "input[0].content[0]",
        ),
        ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id"),
        ({"role": "tool", "content": "x"}, "input[0].role"),
    ],
)
def test_unsupported_items_name_the_param(item: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        responses_to_chat(ResponsesRequest(model="m", input=[item]))
    assert info.value.param == param


def test_conversation_objects_are_rejected_clearly() -> None:
    with pytest.raises(InvalidRequestError, match="resend the whole conversation") as info:
        responses_to_chat(ResponsesRequest(model="m", input="x", conversation="conv_1"))
    assert info.value.param == "conversation"


def test_malformed_tools_rejected_and_tool_choice_mapped() -> None:
    with pytest.raises(ValidationError, match="namespace tool needs"):
        ResponsesRequest(model="m", input="x", tools=[{"type": "namespace", "name": "n"}])
    assert chat_tool_choice({"type": "function", "name": "add"}) == {
        "type": "function",
        "function": {"name": "add"},
    }
    assert chat_tool_choice("required") == "required"


def test_request_accepts_unknown_fields_and_maps_sampling() -> None:
    req = ResponsesRequest.model_validate(
        {
            **AGENTS_TURN_2,
            "max_output_tokens": 9,
            "temperature": 0.2,
            "prompt_cache_key": "k",
            "include": ["message.output_text.logprobs"],
        }
    )
    client = req.client_sampling()
    assert (client.max_tokens, client.temperature) == (9, 0.2)
    assert req.wants_logprobs() == 0
    assert ResponsesRequest.model_validate(AGENTS_TURN_2).wants_logprobs() is None


# ---------------------------------------------------------------- response bodies


@pytest.mark.parametrize(
    "text,eos",
    [
        ("Hello 😀", True),
        ("<think>\nplan\n</think>\n\nCalling.\n" + CALL, True),
        (CALL + "\n" + CALL, True),
        ("cut off mid", False),
    ],
)
def test_build_response_validates(tok: ChatTokenizer, text: str, eos: bool) -> None:
    req = ResponsesRequest.model_validate({**AGENTS_TURN_2, "metadata": {"k": "v"}})
    choice = parse_choice(
        tok, generated(tok, text, eos), completion_id="resp_1", parse_tools=True, logprobs=1
    )
    usage = Usage.of(20, [choice], 3)
    body = build_response(
        req,
        response_id="resp_1",
        created_at=1.5,
        model="areal-policy",
        choice=choice,
        usage=usage,
        sampling=spec(),
    )
    resp = Response.model_validate(body)
    assert resp.id == "resp_1" and resp.object == "response"
    assert resp.instructions == "You add numbers." and resp.metadata == {"k": "v"}
    assert resp.tools[0].name == "add" and resp.parallel_tool_calls is True
    assert resp.usage.input_tokens == 20
    assert resp.usage.input_tokens_details.cached_tokens == 3
    assert resp.usage.input_tokens_details.cache_write_tokens == 0
    assert resp.usage.output_tokens == choice.completion_tokens
    kinds = [item.type for item in resp.output]
    if eos:
        assert resp.status == "completed" and resp.incomplete_details is None
    else:
        assert resp.status == "incomplete"
        assert resp.incomplete_details.reason == "max_output_tokens"
    calls = [i for i in resp.output if i.type == "function_call"]
    assert [c.call_id for c in calls] == [c.id for c in choice.tool_calls]
    assert kinds == sorted(kinds, key=["reasoning", "message", "function_call"].index)
    assert resp.output_text == (choice.content or "")


def test_turn_round_trip_keeps_the_token_prefix(tok: ChatTokenizer) -> None:
    """Output items replayed as input re-render the generated ids exactly."""
    req = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "Add.",
            "tools": [TOOL],
            "input": [{"role": "user", "content": "2+3?"}],
        }
    )
    messages, tools, tool_choice = responses_to_chat(req)
    prompt = render_prompt_ids(tok, messages, tools, tool_choice)
    gen = generated(tok, "<think>\nuse add\n</think>\n\nOn it.\n" + CALL)
    choice = parse_choice(tok, gen, completion_id="resp_2", parse_tools=True)
    body = build_response(
        req,
        response_id="resp_2",
        created_at=1,
        model="m",
        choice=choice,
        usage=Usage.of(len(prompt), [choice]),
        sampling=spec(),
    )
    replay = [item for item in body["output"]]
    call_id = next(i["call_id"] for i in replay if i["type"] == "function_call")
    req2 = ResponsesRequest.model_validate(
        {
            **req.model_dump(exclude_none=True),
            "input": [
                *req.input,
                *replay,
                {"type": "function_call_output", "call_id": call_id, "output": "5"},
            ],
        }
    )
    child = render_prompt_ids(tok, *responses_to_chat(req2))
    assert child[: len(prompt) + len(gen.output_ids)] == prompt + list(gen.output_ids)


# ---------------------------------------------------------------- streaming


def run_stream(
    tok: ChatTokenizer, req: ResponsesRequest, gen: GeneratedChoice, step: int = 1
) -> tuple[list[dict[str, Any]], ResponsesStreamAssembler]:
    asm = ResponsesStreamAssembler(
        req,
        tok,
        response_id="resp_s",
        created_at=2.0,
        model="areal-policy",
        sampling=spec(),
        prompt_tokens=20,
        parse_tools=True,
        logprobs=req.wants_logprobs(),
    )
    events = asm.start()
    n = len(gen.output_ids)
    for end in [*range(step, n, step), n]:
        events += asm.update(
            GeneratedChoice(
                gen.output_ids[:end],
                gen.output_logprobs[:end],
                gen.finish if end == n else None,
                cached_tokens=gen.cached_tokens,
            )
        )
    return events, asm


@pytest.mark.parametrize(
    "text,eos",
    [
        ("Hello 😀 world", True),
        ("<think>\nplan 🤔\n</think>\n\nCalling.\n" + CALL, True),
        (CALL + "\n" + CALL, True),
        ("<think>\nnever closed", False),
        ("", True),
    ],
)
@pytest.mark.parametrize("step", [1, 4])
def test_stream_events_validate_and_end_in_the_built_response(
    tok: ChatTokenizer, text: str, eos: bool, step: int
) -> None:
    req = ResponsesRequest.model_validate(
        {**AGENTS_TURN_2, "include": ["message.output_text.logprobs"]}
    )
    gen = generated(tok, text, eos)
    events, asm = run_stream(tok, req, gen, step)
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress"
    assert events[-1]["type"] == "response.completed"
    assert sum(e["type"] == "response.completed" for e in events) == 1

    choice = parse_choice(tok, gen, completion_id="resp_s", parse_tools=True, logprobs=0)
    assert asm.result == choice
    expected = build_response(
        req,
        response_id="resp_s",
        created_at=2.0,
        model="areal-policy",
        choice=choice,
        usage=Usage.of(20, [choice], 3),
        sampling=spec(),
    )
    assert events[-1]["response"] == expected == asm.response
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [_no_logprobs(i) for i in done] == [_no_logprobs(i) for i in expected["output"]]
    for got, want in zip(done, expected["output"], strict=True):
        if got["type"] == "message":  # closed by a call: the logprobs of the text before it
            lps, full = got["content"][0]["logprobs"], want["content"][0]["logprobs"]
            assert lps == (full[: len(lps)] if choice.tool_calls else full)
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == list(range(len(expected["output"])))

    text_deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text_deltas == (choice.content or "")
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert reasoning == (choice.reasoning_content or "")
    args = [e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done"]
    assert args == [c.arguments for c in choice.tool_calls]
    # Each call streams as generated: added (empty arguments), argument deltas that add
    # up to its arguments byte for byte, arguments.done, output_item.done; with a token
    # per step its arguments arrive in several deltas.
    for k, call in enumerate(choice.tool_calls):
        item_id = done[len(done) - len(choice.tool_calls) + k]["id"]
        mine = [
            e
            for e in events
            if e.get("item_id") == item_id or e.get("item", {}).get("id") == item_id
        ]
        kinds = [e["type"] for e in mine]
        deltas = [e["delta"] for e in mine if e["type"] == "response.function_call_arguments.delta"]
        assert kinds == [
            "response.output_item.added",
            *(["response.function_call_arguments.delta"] * len(deltas)),
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
        assert mine[0]["item"]["arguments"] == "" and mine[0]["item"]["name"] == call.name
        assert "".join(deltas) == call.arguments
        if step == 1:
            assert len(deltas) > 1


def _no_logprobs(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] != "message":
        return item
    return {**item, "content": [{**p, "logprobs": None} for p in item["content"]]}


def test_stream_from_backend_deltas_matches_cumulative(tok: ChatTokenizer) -> None:
    req = ResponsesRequest.model_validate(AGENTS_TURN_2)
    gen = generated(tok, "<think>\nplan\n</think>\n\nOK.\n" + CALL)
    cumulative, _ = run_stream(tok, req, gen, step=2)
    asm = ResponsesStreamAssembler(
        req,
        tok,
        response_id="resp_s",
        created_at=2.0,
        model="areal-policy",
        sampling=spec(),
        prompt_tokens=20,
        parse_tools=True,
        logprobs=None,
    )
    events = asm.start()
    ids, lps = gen.output_ids, gen.output_logprobs
    for start in range(0, len(ids), 2):
        end = min(start + 2, len(ids))
        events += asm.push(
            ids[start:end], lps[start:end], gen.finish if end == len(ids) else None, cached_tokens=3
        )
    assert events == cumulative


def test_stream_message_event_order(tok: ChatTokenizer) -> None:
    req = ResponsesRequest(model="m", input="hi")
    events, _ = run_stream(tok, req, generated(tok, "Hi!"))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    tail = kinds[kinds.index("response.output_text.done") :]
    assert tail == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4 : kinds.index("response.output_text.done")]) == {
        "response.output_text.delta"
    }


def test_failed_event_validates(tok: ChatTokenizer) -> None:
    asm = ResponsesStreamAssembler(
        ResponsesRequest(model="m", input="x"),
        tok,
        response_id="resp_f",
        created_at=1.0,
        model="m",
        sampling=spec(),
        prompt_tokens=3,
        parse_tools=False,
    )
    events = asm.start() + asm.fail("rate_limit_exceeded", "Please try again in 2s.")
    for event in events:
        EVENTS.validate_python(event)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "rate_limit_exceeded"


def test_resolve_sampling_for_responses_names_input(tok: ChatTokenizer) -> None:
    req = ResponsesRequest(model="m", input="x", max_output_tokens=5)
    spec_ = resolve_sampling(
        req.client_sampling(),
        prompt_tokens=3,
        context_length=100,
        default_max_tokens=50,
        mode="client",
        param="input",
    )
    assert spec_.max_new_tokens == 5
