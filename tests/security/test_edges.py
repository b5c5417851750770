"""Integers and strings at the edges: each answered 400 in the OpenAI shape, never a 500,
and the connection stays usable after."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from support.security_harness import STORES

ADMIN = {"authorization": "Bearer sk-test-admin"}


@pytest.fixture(scope="module", params=STORES)
def gw(request: pytest.FixtureRequest, serve_on: Callable[..., Any]) -> Iterator[Any]:
    """One gateway per store backend (PostgreSQL's text refuses NUL, SQLite's takes it)."""
    with serve_on(request.param, "gateway.sampling.default_max_tokens=2") as gateway:
        yield gateway


@pytest.fixture()
def http(gw: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gw.url, headers=ADMIN, timeout=30) as client:
        yield client


def _is_400(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error", error
    return error


@pytest.mark.parametrize("path", ["/admin/keys", "/rl/sessions"])
@pytest.mark.parametrize("offset", [2**63, 2**63 - 1, 2**70, 10**40])
def test_huge_offsets_are_400_and_the_connection_lives(
    http: httpx.Client, path: str, offset: int
) -> None:
    _is_400(http.get(path, params={"offset": offset}))
    _is_400(http.get(path, params={"limit": offset}))
    assert http.get(path, params={"offset": 1_000_000_000}).status_code == 200
    assert http.get(path).status_code == 200  # same keep-alive connection


def test_console_page_beyond_any_offset_is_an_empty_page(gw: Any) -> None:
    import re

    with httpx.Client(base_url=gw.url, timeout=30) as console:
        page = console.get("/console/login")
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
        assert (
            console.post(
                "/console/login", data={"csrf_token": csrf, "admin_key": "sk-test-admin"}
            ).status_code
            == 303
        )
        assert console.get("/console/sessions", params={"page": 2**70}).status_code == 200


def _chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "areal-policy",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **extra,
    }


def _nested_tool_body(path: str, depth: int) -> str:
    """A body for `path` whose one tool has a JSON schema `depth` objects deep (built as
    text: the client's own encoder would give up first)."""
    schema = '{"type": "object", "properties": {"x": ' * depth + '{"type": "string"}' + "}}" * depth
    hi = '[{"role": "user", "content": "hi"}]'
    if path == "/v1/chat/completions":
        return (
            f'{{"model": "m", "max_tokens": 2, "messages": {hi}, "tools": [{{"type": '
            f'"function", "function": {{"name": "f", "parameters": {schema}}}}}]}}'
        )
    if path == "/v1/responses":
        return (
            f'{{"model": "m", "max_output_tokens": 16, "input": "hi", "tools": [{{"type":'
            f' "function", "name": "f", "parameters": {schema}}}]}}'
        )
    return (
        f'{{"model": "m", "max_tokens": 2, "messages": {hi}, "tools": [{{"name": "f", '
        f'"input_schema": {schema}}}]}}'
    )


@pytest.mark.parametrize("depth", [400, 480])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_deeply_nested_tool_schema_is_never_a_500(
    http: httpx.Client, path: str, depth: int
) -> None:
    response = http.post(
        path, content=_nested_tool_body(path, depth), headers={"content-type": "application/json"}
    )
    assert response.status_code < 500, response.text
    assert http.get("/health/liveness").status_code == 200


@pytest.mark.parametrize(
    "extra",
    [
        {"top_k": 2**70},
        {"top_k": 2**31},
        {"top_k": -2},
        {"seed": 2**70},
        {"model": "areal-policy\u0000"},
        {"model": "a" * 10_000},
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_bad_sampling_values_and_models_are_400(
    http: httpx.Client, extra: dict[str, Any], path: str
) -> None:
    if "seed" in extra and path == "/v1/messages":
        pytest.skip("Anthropic's Messages API has no seed")
    _is_400(http.post(path, json=_chat(**extra)))


NUL = "a\u0000b"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/rl/sessions", {"task_id": NUL}),
        ("POST", "/rl/sessions", {"metadata": {"k": NUL}}),
        ("POST", "/rl/sessions", {"metadata": {NUL: 1}}),
        ("POST", "/v1/rewards", {"session_id": NUL, "value": 1}),
        ("POST", "/v1/rewards", {"group_id": "g", "value": 1, "id": NUL}),
        ("POST", "/admin/keys", {"name": NUL}),
        ("POST", "/v1/chat/completions", _chat(metadata={"session_id": NUL})),
        ("POST", "/v1/chat/completions", {**_chat(), "model": NUL}),
        ("POST", "/v1/responses", {"model": "m", "input": "hi", "previous_response_id": NUL}),
        ("GET", "/rl/sessions?task_id=a%00b", None),
    ],
)
def test_nul_characters_are_400(
    http: httpx.Client, method: str, path: str, body: dict[str, Any] | None
) -> None:
    error = _is_400(http.request(method, path, json=body))
    assert "NUL" in error["message"]
    assert http.get("/rl/sessions").status_code == 200


def test_a_nul_in_the_conversation_is_served_and_stored(http: httpx.Client, gw: Any) -> None:
    """Models emit NUL bytes and agents send their output back: a conversation's text
    may hold one, on every backend (stored as JSON)."""
    response = http.post(
        "/v1/chat/completions",
        json={
            "model": "areal-policy",
            "max_tokens": 2,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": NUL},
                {"role": "user", "content": NUL},
            ],
        },
    )
    assert response.status_code == 200, response.text
    stored = gw.state.store.get_completion(response.json()["id"])
    assert stored is not None and stored.request_json["messages"][1]["content"] == NUL


def test_a_literal_backslash_u0000_is_not_a_nul(http: httpx.Client) -> None:
    text = "printf('\\u0000')"  # the six characters, as code an agent might quote
    response = http.post(
        "/v1/chat/completions",
        json={
            "model": "areal-policy",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": text}],
        },
    )
    assert response.status_code == 200, response.text
