"""Responses requests shaped like Codex CLI's against the real gateway and engine: the
agent's own thread id is the session, `store: false` is captured but not chained,
hosted tools are dropped (recorded) or rejected, namespace tools are rendered."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from support.harness import ADMIN_KEY, Gateway, run_gateway, stored_completions

from gateway.sessions import client_session_id

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


def codex_body(thread: str, text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "gpt-5-codex",
        "store": False,
        "stream": False,
        "include": ["reasoning.encrypted_content"],
        "reasoning": {"summary": "auto"},
        "parallel_tool_calls": True,
        "prompt_cache_key": thread,
        "max_output_tokens": 4,
        "client_metadata": {"thread_id": thread, "session_id": thread, "turn_id": "t"},
        "tools": [NAMESPACE, {"type": "web_search", "external_web_access": False}],
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are Codex."}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
        ],
        **extra,
    }


def post(gw: Gateway, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{gw.v1}/responses",
        json=body,
        timeout=60,
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )


def test_codex_thread_is_one_session(gateway: Gateway) -> None:
    first = post(gateway, codex_body("thread-a", "hello"))
    assert first.status_code == 200, first.text
    out = first.json()
    follow = codex_body("thread-a", "hello")
    follow["input"] += [
        *out["output"],
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "more"}]},
    ]
    assert post(gateway, follow).status_code == 200
    assert post(gateway, codex_body("thread-b", "other")).status_code == 200
    one, two, other = stored_completions(gateway.state.store)
    session = client_session_id(type("P", (), {"key_id": None})(), "thread-a")  # admin
    assert one.session_id == two.session_id == session != other.session_id
    assert two.parent_id == one.id
    assert one.response_json["gateway"] == {"dropped_tools": ["web_search"]}
    prompt = gateway.state.tokenizer.decode(list(one.prompt_ids))
    assert "multi_agent_v1.close_agent" in prompt and "web_search" not in prompt
    # store: false -> captured (above) but not kept for previous_response_id
    chained = post(gateway, {"model": "m", "input": "x", "previous_response_id": out["id"]})
    assert chained.status_code == 404


def test_hosted_tools_rejected_when_configured(
    tmp_path: Any, tiny_model_dir: Any, engine_url: str
) -> None:
    with run_gateway(tmp_path, tiny_model_dir, [engine_url], "gateway.hosted_tools=reject") as gw:
        client = openai.OpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="gpt-5-codex", input="hi", tools=[{"type": "web_search"}])
        assert err.value.body["param"] == "tools[0]"  # type: ignore[index]
