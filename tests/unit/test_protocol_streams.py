"""Tool calls streamed on the Anthropic Messages and OpenAI Responses routes, every model
family of the corpus, token by token and in random chunkings: a call opens (id, name) as
soon as its name is known, its arguments follow as generated (the chat stream's call
fragments), and each SDK's own accumulator rebuilds exactly the non-streamed reply."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from support.output_corpus import FAMILIES, TOOLS
from test_output_parsers import PARTIAL_CALL_STREAMED, STREAMED_ARGUMENTS, parser_for

from areal_service.sglang_protocol import FinishReason
from gateway.signing import Signer
from gateway.tokenizer import ChatTokenizer
from gateway.translate import GeneratedChoice, SamplingSpec, Usage, parse_choice
from gateway.wires.anthropic.encode import MessageStreamAssembler, build_message
from gateway.wires.anthropic.translate import tool_input
from gateway.wires.responses.encode import ResponsesStreamAssembler, build_response
from gateway.wires.responses.protocol import ResponsesRequest

ANTHROPIC_EVENTS: TypeAdapter[RawMessageStreamEvent] = TypeAdapter(RawMessageStreamEvent)
RESPONSES_EVENTS: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)
SIGNER = Signer("k")
FINISH = FinishReason("stop")
SPEC = SamplingSpec(
    max_new_tokens=512,
    temperature=1.0,
    top_p=1.0,
    top_k=-1,
    seed=None,
    stop=(),
    n=1,
    mode="training",
)
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def chunkings(n: int, family: str) -> list[list[int]]:
    """Token by token, then three random chunkings of `n` tokens."""
    rng = random.Random(family)
    out = [[1] * n]
    for _ in range(3):
        steps: list[int] = []
        while sum(steps) < n:
            steps.append(rng.randint(1, 7))
        out.append(steps)
    return out


def cases() -> list[tuple[str, str]]:
    return [(family, case.name) for family in sorted(FAMILIES) for case in FAMILIES[family]]


def setup(tok: ChatTokenizer, family: str, name: str) -> tuple[ChatTokenizer, list[int]]:
    """The tiny model's tokenizer with `family`'s parser, and the case's reply ids."""
    tok = ChatTokenizer(tok.core, output_parser=parser_for(family))
    text = next(c.text for c in FAMILIES[family] if c.name == name)
    return tok, tok.core.encode(text)


@pytest.mark.parametrize("family,name", cases())
def test_anthropic_stream_opens_calls_early_and_rebuilds_the_message(
    tok: ChatTokenizer, family: str, name: str
) -> None:
    tok, ids = setup(tok, family, name)
    whole_choice = parse_choice(
        tok,
        GeneratedChoice(tuple(ids), (0.0,) * len(ids), FINISH),
        completion_id="msg_1",
        parse_tools=True,
        tools=TOOLS,
    )
    whole = build_message(
        message_id="msg_1", model="m", choice=whole_choice, usage=Usage(10, len(ids)), signer=SIGNER
    )
    partial = (family, name) in PARTIAL_CALL_STREAMED
    for steps in chunkings(len(ids), family):
        asm = MessageStreamAssembler(
            tok,
            message_id="msg_1",
            model="m",
            sampling=SPEC,
            prompt_tokens=10,
            parse_tools=True,
            signer=SIGNER,
            tools=TOOLS,
        )
        events, pos = asm.start(), 0
        for step in steps:
            end = min(pos + step, len(ids))
            events += asm.push(ids[pos:end], FINISH if end == len(ids) else None)
            pos = end
        events.append(asm.stop())
        snapshot, bufs = None, {}
        for raw in events:
            if raw["type"] != "ping":  # the SDK's SSE decoder skips these
                snapshot = accumulate_event(
                    event=ANTHROPIC_EVENTS.validate_python(raw),
                    current_snapshot=snapshot,
                    json_bufs=bufs,
                )
        assert snapshot is not None and asm.message == whole
        # Blocks never interleave: each one's deltas come between its start and stop.
        open_block = None
        fragments: dict[int, list[str]] = {}
        for e in events:
            if e["type"] == "content_block_start":
                assert open_block is None
                open_block = e["index"]
                if e["content_block"]["type"] == "tool_use":
                    assert e["content_block"]["input"] == {}
                    fragments[e["index"]] = []
            elif e["type"] == "content_block_delta":
                assert e["index"] == open_block
                if e["delta"]["type"] == "input_json_delta":
                    fragments[e["index"]].append(e["delta"]["partial_json"])
            elif e["type"] == "content_block_stop":
                assert e["index"] == open_block
                open_block = None
        if partial:  # a cut-off call was shown; the message keeps its text
            assert len(fragments) <= 1 and not whole_choice.tool_calls
            continue
        rebuilt = snapshot.model_dump(exclude_none=True)["content"]
        assert rebuilt == Message.model_validate(whole).model_dump(exclude_none=True)["content"], (
            family,
            name,
            steps[:3],
        )
        calls = whole_choice.tool_calls
        assert len(fragments) == len(calls)
        for parts, call in zip(fragments.values(), calls, strict=True):
            if call.arguments.startswith("{"):
                assert "".join(parts) == call.arguments  # byte for byte
            assert json.loads("".join(parts)) == tool_input(call.arguments)
            if steps[0] == 1 and family in STREAMED_ARGUMENTS:
                assert len(parts) > 1, (family, name)


@pytest.mark.parametrize("family,name", cases())
def test_responses_stream_opens_calls_early_and_rebuilds_the_response(
    tok: ChatTokenizer, family: str, name: str
) -> None:
    tok, ids = setup(tok, family, name)
    req = ResponsesRequest.model_validate({"model": "m", "input": "go", "tools": RESPONSE_TOOLS})
    whole_choice = parse_choice(
        tok,
        GeneratedChoice(tuple(ids), (0.0,) * len(ids), FINISH),
        completion_id="resp_1",
        parse_tools=True,
        tools=TOOLS,
    )
    whole = build_response(
        req,
        response_id="resp_1",
        created_at=1.0,
        model="m",
        choice=whole_choice,
        usage=Usage.of(10, [whole_choice]),
        sampling=SPEC,
    )
    partial = (family, name) in PARTIAL_CALL_STREAMED
    for steps in chunkings(len(ids), family):
        asm = ResponsesStreamAssembler(
            req,
            tok,
            response_id="resp_1",
            created_at=1.0,
            model="m",
            sampling=SPEC,
            prompt_tokens=10,
            parse_tools=True,
            tools=TOOLS,
        )
        events, pos = asm.start(), 0
        for step in steps:
            end = min(pos + step, len(ids))
            events += asm.push(
                ids[pos:end], [0.0] * (end - pos), FINISH if end == len(ids) else None
            )
            pos = end
        state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
        for raw in events:
            state.handle_event(RESPONSES_EVENTS.validate_python(raw))
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] == "response.completed"
        assert events[-1]["response"] == whole == asm.response
        # Items never interleave: each one's events come between its added and done.
        open_item: str | None = None
        deltas: dict[str, list[str]] = {}
        done: list[dict[str, Any]] = []
        for e in events[2:-1]:
            if e["type"] == "response.output_item.added":
                assert open_item is None
                open_item = e["item"]["id"]
                if e["item"]["type"] == "function_call":
                    assert e["item"]["arguments"] == "" and e["item"]["name"]
                    deltas[open_item] = []
            elif e["type"] == "response.output_item.done":
                assert e["item"]["id"] == open_item
                open_item = None
                done.append(e["item"])
            else:
                assert e["item_id"] == open_item, e
                if e["type"] == "response.function_call_arguments.delta":
                    deltas[open_item].append(e["delta"])
        calls = [i for i in done if i["type"] == "function_call"]
        if partial:  # a cut-off call was shown and ends incomplete; the reply keeps its text
            assert len(calls) <= 1 and all(c["status"] == "incomplete" for c in calls)
            assert not whole_choice.tool_calls
            continue
        assert done == whole["output"], (family, name, steps[:3])
        for item in calls:
            assert "".join(deltas[item["id"]]) == item["arguments"]  # byte for byte
            if steps[0] == 1 and family in STREAMED_ARGUMENTS:
                assert len(deltas[item["id"]]) > 1, (family, name)
