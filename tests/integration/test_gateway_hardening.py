"""What a hostile or unlucky client sends, answered in the OpenAI error shape and never
with a 500: deeply nested JSON on every body route, negative paging, parameters that
would change sampling but cannot be honoured, strings where numbers belong."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

AUTH = {"Authorization": "Bearer sk-test-admin", "content-type": "application/json"}
MODEL = "areal-policy"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gw(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, engine_url: str
) -> Iterator[Any]:
    from support.harness import run_gateway

    with run_gateway(
        tmp_path_factory.mktemp("hardening"),
        tiny_model_dir,
        [engine_url],
        "gateway.sampling.default_max_tokens=2",
    ) as gateway:
        yield gateway


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _bodies(depth: int) -> dict[str, str]:
    """A body per route whose free-form field holds `depth` nested lists."""
    deep = _nested(depth)
    return {
        "/v1/chat/completions": f'{{"model": "{MODEL}", "messages": {json.dumps(HI)}, '
        f'"metadata": {{"x": {deep}}}}}',
        "/v1/responses": f'{{"model": "{MODEL}", "input": "hi", "metadata": {{"x": {deep}}}}}',
        "/v1/rewards": f'{{"group_id": "g", "value": 1, "metadata": {{"x": {deep}}}}}',
        "/rl/sessions": f'{{"metadata": {{"x": {deep}}}}}',
        "/admin/keys": f'{{"name": "k", "metadata": {{"x": {deep}}}}}',
    }


@pytest.mark.parametrize("depth", [1000, 100_000])
@pytest.mark.parametrize("path", list(_bodies(1)))
def test_deeply_nested_body_is_400(gw: Any, path: str, depth: int) -> None:
    response = httpx.post(gw.url + path, content=_bodies(depth)[path], headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", list(_bodies(1)))
def test_moderately_nested_body_is_never_a_500(gw: Any, path: str) -> None:
    response = httpx.post(gw.url + path, content=_bodies(200)[path], headers=AUTH, timeout=60)
    assert response.status_code < 500, response.text


@pytest.mark.parametrize("path", ["/rl/sessions", "/admin/keys"])
@pytest.mark.parametrize("query", ["limit=-1", "offset=-5"])
def test_negative_paging_is_400(gw: Any, path: str, query: str) -> None:
    response = httpx.get(f"{gw.url}{path}?{query}", headers=AUTH, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == query.split("=")[0]


def _chat(gw: Any, **fields: Any) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        headers=AUTH,
        timeout=60,
        json={"model": MODEL, "messages": HI, **fields},
    )


ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": "10"}, "max_tokens"),
        ({"n": "2"}, "n"),
        ({"temperature": "0.5"}, "temperature"),
        ({"stream": "false"}, "stream"),
        ({"logprobs": 1}, "logprobs"),
        ({"logit_bias": {"abc": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"logit_bias": {"5": "1"}}, "logit_bias"),
        (
            {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "tool_choice",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [ADD], "tool_choice": {"type": "function", "function": "add"}}, "tool_choice"),
        ({"functions": [ADD["function"]], "function_call": {"name": "mul"}}, "function_call"),
    ],
)
def test_unservable_sampling_and_tool_choice_are_400(
    gw: Any, fields: dict[str, Any], param: str
) -> None:
    """Never coerced or silently ignored: a string where a number belongs, a logit_bias
    that is not {token id: bias in [-100, 100]}, a tool_choice no offered tool meets."""
    response = _chat(gw, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].split(".")[0] == param  # or deeper: logit_bias.5


def test_responses_tool_choice_must_name_an_offered_function(gw: Any) -> None:
    response = httpx.post(
        gw.url + "/v1/responses",
        headers=AUTH,
        timeout=60,
        json={
            "model": MODEL,
            "input": "hi",
            "tool_choice": {"type": "function", "name": "mul"},
            "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
        },
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tool_choice"
    assert (
        httpx.post(
            gw.url + "/v1/responses",
            headers=AUTH,
            timeout=60,
            json={"model": MODEL, "input": "hi", "max_output_tokens": "3"},
        ).status_code
        == 400
    )


def test_logit_bias_reaches_the_backend_as_sglang_sampling_params(gw: Any) -> None:
    """OpenAI's {"token id": bias} is SGLang's `logit_bias` sampling param (client
    sampling mode); the served ids are recorded as usual."""
    from gateway.translate import resolve_sampling
    from gateway.wires.chat.protocol import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": HI, "logit_bias": {"7": -100, "12": 2.5}}
    )
    spec = resolve_sampling(
        request.client_sampling(),
        prompt_tokens=3,
        context_length=64,
        default_max_tokens=2,
        mode="client",
    )
    assert spec.to_sampling_params()["logit_bias"] == {"7": -100.0, "12": 2.5}
    training = resolve_sampling(
        request.client_sampling(),
        prompt_tokens=3,
        context_length=64,
        default_max_tokens=2,
        mode="training",
    )
    assert "logit_bias" not in training.to_sampling_params()


def test_logit_bias_changes_what_is_sampled_in_client_mode(
    tmp_path: Path, tiny_model_dir: Path, engine_url: str, gateway_factory: Any, completions_of: Any
) -> None:
    """Through the gateway to the engine: +100 on one token id makes every sampled token
    that id, and the recorded output ids say so."""
    with gateway_factory(
        tmp_path, tiny_model_dir, [engine_url], "gateway.sampling.mode=client"
    ) as g:
        reply = _chat(g, logit_bias={"42": 100}, max_tokens=3, temperature=1.0)
        assert reply.status_code == 200, reply.text
        (record,) = [r for r in completions_of(g.state.store) if r.id == reply.json()["id"]]
    assert list(record.output_ids) == [42, 42, 42]
