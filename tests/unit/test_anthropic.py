"""Anthropic Messages translation: replies and streamed events as the `anthropic` SDK
parses them (its own accumulator rebuilds the message), and history back to chat."""

from __future__ import annotations

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter
from support.tokenizer_reference import hf

from areal_service.sglang_protocol import FinishReason
from gateway.signing import Signer
from gateway.translate import ChatTokenizer, GeneratedChoice, SamplingSpec, Usage, parse_choice
from gateway.wires.anthropic.encode import MessageStreamAssembler, build_message
from gateway.wires.anthropic.protocol import MessagesRequest
from gateway.wires.anthropic.translate import anthropic_to_chat

EVENTS: TypeAdapter[RawMessageStreamEvent] = TypeAdapter(RawMessageStreamEvent)
SIGNER = Signer("k")
TEXT = (
    '<think>\nadd them\n</think>\n\nLet me add.\n<tool_call>\n{"name": "add", '
    '"arguments": {"a": 2, "b": 3}}\n</tool_call>'
)


def generated(text: str) -> GeneratedChoice:
    end = hf().convert_tokens_to_ids("<|im_end|>")
    ids = [*hf().encode(text, add_special_tokens=False), end]
    return GeneratedChoice(tuple(ids), tuple(-0.1 for _ in ids), FinishReason("stop", end))


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


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_events_rebuild_the_message(tok: ChatTokenizer, step: int) -> None:
    gen = generated(TEXT)
    asm = MessageStreamAssembler(
        tok,
        message_id="msg_1",
        model="claude-x",
        sampling=spec(),
        prompt_tokens=10,
        parse_tools=True,
        signer=SIGNER,
    )
    events = asm.start()
    ids = gen.output_ids
    for i in range(0, len(ids), step):
        events += asm.push(ids[i : i + step], gen.finish if i + step >= len(ids) else None)
    events.append(asm.stop())
    snapshot = None
    json_bufs: dict[int, bytes] = {}  # the SDK's per-block buffers of input_json_delta
    for raw in events:
        if raw["type"] == "ping":  # the SDK's SSE decoder skips these
            continue
        snapshot = accumulate_event(
            event=EVENTS.validate_python(raw), current_snapshot=snapshot, json_bufs=json_bufs
        )
    assert snapshot is not None and asm.message is not None
    assert [e["type"] for e in events][:2] == ["message_start", "ping"]
    rebuilt = snapshot.model_dump(exclude_none=True)
    assert rebuilt["content"] == asm.message["content"]
    assert [b["type"] for b in rebuilt["content"]] == ["thinking", "text", "tool_use"]
    assert rebuilt["stop_reason"] == "tool_use"
    choice = parse_choice(tok, gen, completion_id="msg_1", parse_tools=True)
    whole = build_message(
        message_id="msg_1",
        model="claude-x",
        choice=choice,
        usage=Usage(10, len(ids)),
        signer=SIGNER,
    )
    assert (
        Message.model_validate(whole).model_dump(exclude_none=True)["content"] == rebuilt["content"]
    )
    # The call streams as generated: its block opens before its arguments are complete,
    # and the fragments add up to the generated arguments text, byte for byte.
    fragments = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert "".join(fragments) == choice.tool_calls[0].arguments
    if step == 1:
        assert len(fragments) > 1
    kinds = [
        (e["type"], e.get("content_block", e.get("delta", {})).get("type"))
        for e in events
        if e["type"].startswith("content_block")
    ]
    start = kinds.index(("content_block_start", "tool_use"))
    assert kinds[start + 1 :] == [("content_block_delta", "input_json_delta")] * len(fragments) + [
        ("content_block_stop", None)
    ]


def test_reply_replayed_renders_the_same_assistant_turn(tok: ChatTokenizer) -> None:
    choice = parse_choice(tok, generated(TEXT), completion_id="msg_1", parse_tools=True)
    reply = build_message(
        message_id="msg_1", model="m", choice=choice, usage=Usage(1, 1), signer=SIGNER
    )
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "add 2 and 3"},
                {"role": "assistant", "content": reply["content"]},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": choice.tool_calls[0].id,
                            "content": "5",
                        },
                        {"type": "text", "text": "thanks"},
                    ],
                },
            ],
        }
    )
    messages, _, _, _ = anthropic_to_chat(req)
    assert messages[1] == choice.to_message() | {"content": "Let me add."}
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": choice.tool_calls[0].id, "content": "5"},
        {"role": "user", "content": "thanks"},
    ]
