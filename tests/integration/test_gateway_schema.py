"""The served `/openapi.json` documents every public route with its bodies, and what the
two hot routes (parsed by their own code outside FastAPI) accept and refuse is exactly
what their documented request models accept and refuse, on a corpus of valid and
invalid bodies. Replies validate against the documented reply models."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from gateway.protocol import InvalidRequestError
from gateway.wires.chat.protocol import ChatCompletion, ChatCompletionRequest
from gateway.wires.responses.protocol import Response, ResponsesRequest
from gateway.wires.routes import HOT_ROUTES

AUTH = {"Authorization": "Bearer sk-test-admin"}
MODEL = "areal-policy"
HI = [{"role": "user", "content": "hi"}]

CHAT_BODIES: list[Any] = [
    # served
    {"model": MODEL, "messages": HI},
    {"model": MODEL, "messages": HI, "temperature": 0, "top_p": 1, "n": 2, "seed": 3},
    {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "x"}]},
        ],
    },
    {
        "model": MODEL,
        "messages": HI,
        "stop": ["a", "b"],
        "max_completion_tokens": 1,
        "unknown_extension": {"kept": True},
        "metadata": {"k": "v"},
        "user": "u",
    },
    {
        "model": MODEL,
        "messages": HI,
        "tools": [
            {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
        ],
        "tool_choice": "auto",
    },
    {
        "model": MODEL,
        "messages": [
            *HI,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "1"},
        ],
    },
    {"model": MODEL, "messages": HI, "logprobs": True, "top_logprobs": 2, "top_k": 5},
    # refused
    b"not json",
    b"[1, 2]",
    {"messages": HI},
    {"model": 5, "messages": HI},
    {"model": MODEL},
    {"model": MODEL, "messages": []},
    {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
    {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
    {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"model": MODEL, "messages": HI, "temperature": "hot"},
    {"model": MODEL, "messages": HI, "temperature": 3},
    {"model": MODEL, "messages": HI, "n": 0},
    {"model": MODEL, "messages": HI, "max_tokens": 0},
    {"model": MODEL, "messages": HI, "top_logprobs": 50},
    {"model": MODEL, "messages": HI, "stop": 5},
    {"model": MODEL, "messages": HI, "tools": [{"type": "web_search"}]},
    {"model": MODEL, "messages": HI, "tool_choice": "sometimes"},
    {"model": MODEL, "messages": HI, "seed": 2**70},
    {"model": MODEL, "messages": HI, "top_k": -5},
    {"model": MODEL, "messages": HI, "stream_options": 3},
]
RESPONSES_BODIES: list[Any] = [
    # served
    {"model": MODEL, "input": "hi"},
    {"model": MODEL, "input": "hi", "instructions": "be brief", "temperature": 0.5},
    {
        "model": MODEL,
        "input": [{"role": "user", "content": "hi"}],
        "store": False,
        "include": [],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
    },
    {
        "model": MODEL,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "1"},
        ],
    },
    {
        "model": MODEL,
        "input": "hi",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    },
    {"model": MODEL, "input": [], "instructions": "say hi"},
    # refused
    b"not json",
    {"input": "hi"},
    {"model": MODEL, "input": 5},
    {"model": MODEL, "input": [5]},
    {"model": MODEL, "input": []},
    {"model": MODEL, "input": [{"type": "reasoning", "summary": []}]},
    {"model": MODEL, "input": [{"role": "user", "content": 5}]},
    {"model": MODEL, "input": [{"role": "user", "content": [5]}]},
    {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
    {"model": MODEL, "input": [{"role": "wizard", "content": "x"}]},
    {"model": MODEL, "input": [{"role": ["user"], "content": "x"}]},
    {"model": MODEL, "input": [{"type": "function_call", "name": "f"}]},
    {"model": MODEL, "input": [{"type": "function_call_output", "output": "5"}]},
    {
        "model": MODEL,
        "input": [{"type": "function_call_output", "call_id": "c", "output": {"x": 1}}],
    },
    {"model": MODEL, "input": [{"type": "web_search_call"}]},
    {"model": MODEL, "input": [{"type": "reasoning", "summary": 5}]},
    {"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]},
    {"model": MODEL, "input": "hi", "conversation": "conv_1"},
    {"model": MODEL, "input": "hi", "max_output_tokens": 0},
]


@pytest.fixture(scope="module")
def gw(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, engine_url: str
) -> Iterator[Any]:
    from support.harness import run_gateway

    with run_gateway(
        tmp_path_factory.mktemp("schema"),
        tiny_model_dir,
        [engine_url],
        "gateway.sampling.default_max_tokens=2",
        "gateway.sampling.mode=client",
    ) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def openapi(gw: Any) -> dict[str, Any]:
    response = httpx.get(
        gw.url + "/openapi.json",
        headers={"authorization": f"Bearer {gw.config.gateway.auth.admin_key.get_secret_value()}"},
    )
    assert response.status_code == 200
    return response.json()


def _model_accepts(model: type[BaseModel], body: Any) -> bool:
    """What the documented request model says of `body` (raw bytes: parsed first)."""
    try:
        data = json.loads(body) if isinstance(body, bytes) else body
        if not isinstance(data, dict):
            return False
        model.model_validate(data)
    except (ValueError, ValidationError, InvalidRequestError):
        return False
    return True


def _served(gw: Any, path: str, body: Any) -> bool:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        gw.url + path,
        content=content,
        timeout=60,
        headers={"content-type": "application/json", **AUTH},
    )
    assert response.status_code in (200, 400), response.text
    return response.status_code == 200


def _schema_accepts(openapi: dict[str, Any], path: str, body: Any) -> bool:
    """What `/openapi.json`'s request schema for `path` says of `body` (JSON Schema)."""
    media = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    schema = {**media["schema"], "components": openapi["components"]}
    return jsonschema.Draft202012Validator(schema).is_valid(body)


@pytest.mark.parametrize(
    ("path", "model", "body"),
    [
        *(("/v1/chat/completions", ChatCompletionRequest, b) for b in CHAT_BODIES),
        *(("/v1/responses", ResponsesRequest, b) for b in RESPONSES_BODIES),
    ],
)
def test_hot_path_accepts_what_the_schema_accepts(
    gw: Any, openapi: dict[str, Any], path: str, model: type[BaseModel], body: Any
) -> None:
    served = _served(gw, path, body)
    assert served == _model_accepts(model, body)
    if served:  # the published JSON Schema never refuses a body the gateway serves
        assert _schema_accepts(openapi, path, body)


def test_openapi_documents_every_public_route(gw: Any, openapi: dict[str, Any]) -> None:
    paths = openapi["paths"]
    public = {
        (route.path, method)
        for route in gw.app.routes
        if isinstance(route, APIRoute) and route.include_in_schema
        for method in route.methods
    }
    assert public <= {(p, m.upper()) for p, ops in paths.items() for m in ops}
    for path in ("/v1/chat/completions", "/v1/responses"):  # served outside FastAPI
        assert path in HOT_ROUTES and "post" in paths[path]
    bodiless = {"/admin/keys/{key_id}/revoke"}  # an action on the key named in the path
    posts = {p: ops["post"] for p, ops in paths.items() if "post" in ops}
    assert set(posts) >= {
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/rewards",
        "/rl/sessions",
        "/rl/sessions/{session_id}/end",
        "/admin/keys",
    }
    for path, op in posts.items():
        if path in bodiless:
            continue
        assert "application/json" in op.get("requestBody", {}).get("content", {}), path
    refs = {
        p: posts[p]["requestBody"]["content"]["application/json"]["schema"]
        for p in ("/v1/chat/completions", "/v1/responses", "/v1/rewards")
    }
    assert refs["/v1/chat/completions"]["$ref"].endswith("/ChatCompletionRequest")
    assert refs["/v1/responses"]["$ref"].endswith("/ResponsesRequest")
    assert refs["/v1/rewards"]["$ref"].endswith("/RewardCreate")
    for path, ops in paths.items():  # every reply documented with a schema
        for op in ops.values():
            ok = op["responses"].get("200") or op["responses"].get("201")
            assert ok is not None and ok.get("content"), path
    assert not any(p.startswith("/console") for p in paths)


def test_replies_match_the_documented_models(gw: Any) -> None:
    chat = httpx.post(
        gw.url + "/v1/chat/completions",
        headers=AUTH,
        timeout=60,
        json={"model": MODEL, "messages": HI, "n": 2, "logprobs": True},
    )
    ChatCompletion.model_validate(chat.json())
    response = httpx.post(
        gw.url + "/v1/responses", headers=AUTH, timeout=60, json={"model": MODEL, "input": "hi"}
    )
    Response.model_validate(response.json())
