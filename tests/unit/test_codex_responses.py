"""Responses as Codex CLI 0.169 sends it: namespace tools flattened (and calls returned
under their namespace), hosted tools dropped or rejected, developer messages, sealed
reasoning (`include: ["reasoning.encrypted_content"]`) that round-trips."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import Response
from support.tokenizer_reference import hf

from areal_service.sglang_protocol import FinishReason
from gateway.protocol import InvalidRequestError
from gateway.signing import Signer
from gateway.translate import (
    ChatTokenizer,
    GeneratedChoice,
    SamplingSpec,
    Usage,
    parse_choice,
)
from gateway.wires.responses.encode import ResponsesStreamAssembler, build_response
from gateway.wires.responses.protocol import ResponsesRequest
from gateway.wires.responses.translate import translate_request

FN = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a command.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
    },
}
NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "close_agent",
            "strict": False,
            "description": "Close an agent.",
            "parameters": {
                "type": "object",
                "properties": {"target": {"type": "string"}},
                "required": ["target"],
            },
        }
    ],
}
CODEX_BODY: dict[str, Any] = {
    "model": "gpt-5-codex",
    "stream": True,
    "store": False,
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"},
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "t1",
    "client_metadata": {"thread_id": "t1", "session_id": "t1", "turn_id": "u1"},
    "tools": [FN, NAMESPACE, {"type": "web_search", "external_web_access": False}],
    "input": [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "You are Codex."}],
        },
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "close agent a1"}],
        },
    ],
}
SIGNER = Signer("sk-test-admin")


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


def generated(text: str) -> GeneratedChoice:
    end = hf().convert_tokens_to_ids("<|im_end|>")
    ids = [*hf().encode(text, add_special_tokens=False), end]
    return GeneratedChoice(tuple(ids), tuple(-0.1 for _ in ids), FinishReason("stop", end))


def test_codex_body_translates() -> None:
    req = ResponsesRequest.model_validate(CODEX_BODY)
    conv = translate_request(req, signer=SIGNER)
    assert conv.messages == [
        {"role": "system", "content": "You are Codex."},
        {"role": "user", "content": "close agent a1"},
    ]
    assert [t["function"]["name"] for t in conv.tools or ()] == [
        "exec_command",
        "multi_agent_v1.close_agent",
    ]
    assert conv.dropped_tools == ["web_search"]
    assert req.model_extra is not None and req.model_extra["prompt_cache_key"] == "t1"
    with pytest.raises(InvalidRequestError, match="web_search") as rejected:
        translate_request(req, hosted_tools="reject")
    assert rejected.value.param == "tools[2]"


def test_namespaced_call_comes_back_under_its_namespace_and_replays(tok: ChatTokenizer) -> None:
    req = ResponsesRequest.model_validate({**CODEX_BODY, "stream": False})
    text = (
        '<think>\nclose it\n</think>\n\n<tool_call>\n{"name": '
        '"multi_agent_v1.close_agent", "arguments": {"target": "a1"}}\n</tool_call>'
    )
    choice = parse_choice(tok, generated(text), completion_id="resp_1", parse_tools=True)
    body = build_response(
        req,
        response_id="resp_1",
        created_at=1.0,
        model="gpt-5-codex",
        choice=choice,
        usage=Usage(10, 5),
        sampling=spec(),
        signer=SIGNER,
    )
    Response.model_validate(body)
    reasoning, call = body["output"]
    assert (call["namespace"], call["name"]) == ("multi_agent_v1", "close_agent")
    assert reasoning["encrypted_content"] and reasoning["content"][0]["text"] == "close it"
    # Codex (store: false) resends the items; reasoning only as encrypted_content
    replay = {
        **CODEX_BODY,
        "input": [
            *CODEX_BODY["input"],
            {**reasoning, "content": None},
            {k: v for k, v in call.items() if k != "id"},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "closed"},
        ],
    }
    conv = translate_request(ResponsesRequest.model_validate(replay), signer=SIGNER)
    assistant = conv.messages[2]
    assert assistant["reasoning_content"] == "close it"
    assert assistant["tool_calls"][0]["function"]["name"] == "multi_agent_v1.close_agent"
    assert assistant["tool_calls"][0]["id"] == choice.tool_calls[0].id


def test_forged_encrypted_content_is_refused() -> None:
    forged = {
        **CODEX_BODY,
        "input": [
            *CODEX_BODY["input"],
            {"type": "reasoning", "summary": [], "encrypted_content": Signer("other").seal("x")},
            {"type": "message", "role": "assistant", "content": "ok"},
            {"type": "message", "role": "user", "content": "more"},
        ],
    }
    with pytest.raises(InvalidRequestError, match="encrypted_content") as err:
        translate_request(ResponsesRequest.model_validate(forged), signer=SIGNER)
    assert err.value.param == "input[2].encrypted_content"


def test_stream_final_response_matches(tok: ChatTokenizer) -> None:
    req = ResponsesRequest.model_validate(CODEX_BODY)
    text = (
        '<tool_call>\n{"name": "multi_agent_v1.close_agent", "arguments": '
        '{"target": "a1"}}\n</tool_call>'
    )
    gen = generated(text)
    asm = ResponsesStreamAssembler(
        req,
        tok,
        response_id="resp_s",
        created_at=2.0,
        model="gpt-5-codex",
        sampling=spec(),
        prompt_tokens=20,
        parse_tools=True,
        signer=SIGNER,
    )
    events = asm.start() + asm.push(gen.output_ids, gen.output_logprobs, gen.finish)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done[-1]["namespace"] == "multi_agent_v1" and done[-1]["name"] == "close_agent"
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"] == done
