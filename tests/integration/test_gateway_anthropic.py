"""The Anthropic Messages route with the official `anthropic` SDK against the real gateway
and the local engine (tiny model): replies and events as the SDK parses them, captured
like every other route (exact ids, sessions, parent links, continuity)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from support.harness import ADMIN_KEY, Gateway, run_gateway, stored_completions
from support.tool_model import (
    AGENT_INPUT,
    AGENT_INSTRUCTIONS,
    ANSWER_TEXT,
    CALL_ARGUMENTS,
    TOOL_RESULT,
    round_trip_examples,
    train_tool_model,
)

from engine.testing import start_engine_in_thread

MODEL = "claude-opus-4-8[1m]"
TOOLS = [
    {
        "name": "add",
        "description": "Add two integers.",
        "input_schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
    {
        "name": "multiply",
        "description": "Multiply two integers.",
        "input_schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
]
"""The calculator's tools as Anthropic clients send them."""


def _client(gw: Gateway, key: str = ADMIN_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)


def _user_key(gw: Gateway) -> str:
    reply = httpx.post(
        f"{gw.url}/admin/keys",
        json={"name": "claude"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert reply.status_code in (200, 201), reply.text
    return str(reply.json()["api_key"])


def test_message_non_streamed_is_captured(gateway: Gateway) -> None:
    client = _client(gateway)
    msg = client.messages.create(
        model=MODEL,
        max_tokens=8,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "hello"}],
        metadata={"user_id": "u1"},
        extra_body={"context_management": {"edits": []}, "output_config": {"effort": "low"}},
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.content and msg.content[0].type == "text"
    (record,) = stored_completions(gateway.state.store)
    assert record.id == msg.id and record.requested_model == MODEL
    assert msg.usage.input_tokens == len(record.prompt_ids)
    assert msg.usage.output_tokens == len(record.output_ids)
    assert record.request_json["context_management"] == {"edits": []}
    text = gateway.state.tokenizer.decode(list(record.prompt_ids))
    assert "Be brief." in text and "hello" in text


def test_message_streamed_events(gateway: Gateway) -> None:
    client = _client(gateway)
    kinds: list[str] = []
    with client.messages.stream(
        model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    (record,) = stored_completions(gateway.state.store)
    assert record.id == final.id and final.usage.output_tokens == len(record.output_ids)
    assert record.response_json["content"] == [
        b.model_dump(exclude_none=True) for b in final.content
    ]


def test_errors_take_anthropic_shape(gateway: Gateway) -> None:
    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        _client(gateway, "sk-wrong").messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    assert bad_key.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    reply = httpx.post(
        f"{gateway.url}/v1/messages?beta=true",
        headers={"x-api-key": ADMIN_KEY},
        json={
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        },
    )
    assert reply.status_code == 400
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "image" in body["error"]["message"]


def test_count_tokens_matches_the_prompt(gateway: Gateway) -> None:
    client = _client(gateway)
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "system": "sys",
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "count me"}],
    }
    counted = client.messages.count_tokens(**kwargs)
    msg = client.messages.create(max_tokens=2, **kwargs)
    assert counted.input_tokens == msg.usage.input_tokens > 0
    (record,) = stored_completions(gateway.state.store)
    assert '"name": "add"' in gateway.state.tokenizer.decode(list(record.prompt_ids))


def test_hosted_tools_dropped_and_recorded(gateway: Gateway) -> None:
    client = _client(gateway)
    client.messages.create(
        model=MODEL,
        max_tokens=2,
        tools=[*TOOLS, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        messages=[{"role": "user", "content": "search"}],
    )
    (record,) = stored_completions(gateway.state.store)
    assert record.response_json["gateway"] == {"dropped_tools": ["web_search"]}
    assert "web_search" not in gateway.state.tokenizer.decode(list(record.prompt_ids))


# ---------------------------------------------------------------- tool round trip


@pytest.fixture(scope="module")
def anthropic_tool_model(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, engine_url: str
) -> Path:
    """The tiny model fine-tuned to call `add(2, 3)` on the calculator prompt as this
    route renders it, then to answer after the tool result."""
    from transformers import AutoTokenizer

    with run_gateway(
        tmp_path_factory.mktemp("anthropic-record"), tiny_model_dir, [engine_url]
    ) as gw:
        _client(gw).messages.create(
            model=MODEL,
            max_tokens=1,
            system=AGENT_INSTRUCTIONS,
            tools=TOOLS,
            messages=[{"role": "user", "content": AGENT_INPUT}],
        )
        (record,) = stored_completions(gw.state.store)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return train_tool_model(
        tiny_model_dir,
        tmp_path_factory.mktemp("models") / "atool",
        round_trip_examples(tokenizer, record.prompt_ids),
    )


@pytest.fixture()
def tool_gw(tmp_path: Path, anthropic_tool_model: Path) -> Iterator[Gateway]:
    with (
        start_engine_in_thread(anthropic_tool_model) as url,
        run_gateway(tmp_path, anthropic_tool_model, [url], "gateway.sampling.mode=client") as gw,
    ):
        yield gw


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip(tool_gw: Gateway, stream: bool) -> None:
    """tool_use out, tool_result in, the answer: one session, the second completion's
    parent is the first and its prompt continues the first's exact ids."""
    client = _client(tool_gw, _user_key(tool_gw))
    messages: list[dict[str, Any]] = [{"role": "user", "content": AGENT_INPUT}]
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 64,
        "system": AGENT_INSTRUCTIONS,
        "tools": TOOLS,
        "extra_body": {"temperature": 0.0},
    }
    # (greedy; the current SDK has no `temperature` argument, the API still takes it)

    fragments: list[str] = []

    def call() -> anthropic.types.Message:
        if stream:
            with client.messages.stream(messages=messages, **kwargs) as s:
                fragments.extend(
                    e.delta.partial_json
                    for e in s
                    if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
                )
                return s.get_final_message()
        return client.messages.create(messages=messages, **kwargs)

    first = call()
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "add" and use.input == json.loads(CALL_ARGUMENTS)
    if stream:  # the input streamed as generated, the SDK accumulating the fragments
        assert len(fragments) > 1 and "".join(fragments) == CALL_ARGUMENTS
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULT}],
        },
    ]
    second = call()
    assert second.stop_reason == "end_turn"
    assert [b.text for b in second.content if b.type == "text"] == [ANSWER_TEXT]
    one, two = stored_completions(tool_gw.state.store)
    assert (one.id, two.id) == (first.id, second.id)
    assert one.session_id is not None and two.session_id == one.session_id
    assert two.parent_id == one.id
    assert two.prompt_ids[: len(one.prompt_ids) + len(one.output_ids)] == (
        *one.prompt_ids,
        *one.output_ids,
    )


def test_claude_code_default_request_shape(gateway: Gateway) -> None:
    """Claude Code's default body: a `system` message inside `messages`, thinking,
    context management, metadata.user_id carrying its session: served, and the session
    comes from Claude Code's own id."""
    body = {
        "model": "claude-opus-4-8",
        "max_tokens": 4,
        "stream": False,
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
        "metadata": {
            "user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": "cc-1"})
        },
        "system": [{"type": "text", "text": "You are Claude Code."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "system", "content": "Available agent types: none"},
        ],
    }
    reply = httpx.post(
        f"{gateway.url}/v1/messages?beta=true",
        json=body,
        timeout=60,
        headers={"x-api-key": ADMIN_KEY, "anthropic-version": "2023-06-01"},
    )
    assert reply.status_code == 200, reply.text
    (record,) = stored_completions(gateway.state.store)
    assert record.session_id is not None and record.session_id.startswith("sess_c")
    assert "Available agent types" in gateway.state.tokenizer.decode(list(record.prompt_ids))


def test_replayed_thinking_needs_this_gateways_signature(gateway: Gateway) -> None:
    """Replayed thinking goes into the prompt as the policy's own reasoning, so (as on
    Anthropic's API) a thinking block is accepted only with the signature this gateway
    issued for its text; a missing, foreign or edited one is a 400 naming the field."""
    from gateway.wires.common import reasoning_signer

    signer = reasoning_signer(gateway.state)

    def ask(signature: str) -> httpx.Response:
        return httpx.post(
            f"{gateway.url}/v1/messages",
            headers={"x-api-key": ADMIN_KEY},
            timeout=60,
            json={
                "model": MODEL,
                "max_tokens": 2,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "thinking", "thinking": "I think so.", "signature": signature},
                            {"type": "text", "text": "yes"},
                        ],
                    },
                    {"role": "user", "content": "and?"},
                ],
            },
        )

    assert ask(signer.sign("I think so.")).status_code == 200
    for forged in ("", "AAAA", signer.sign("I think so, edited.")):
        reply = ask(forged)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and "signature" in error["message"]
