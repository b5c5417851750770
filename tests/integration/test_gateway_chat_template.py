"""Real checkpoints' chat templates behind the gateway (echo backend, tiny model's tokenizer
files with another template): SmolLM2's template serves a tool round whose assistant turn
has `content: null`; a template that refuses a conversation (Gemma 2's: no system role)
is a 400 in each wire API's error shape, never a 500; `/admin/status` says whether the
template renders tools, and `engine.chat_template=builtin:chatml-tools` makes it so."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.chat_templates import SMOLLM2_TEMPLATE, TOOLS, tokenizer_dir_with_template
from support.harness import ADMIN_KEY, Gateway, run_gateway

from engine.echo_backend import EchoBackendHandle, start_echo_backend

AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
MODEL = "areal-policy"


GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}"
    "{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + "
    "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{'<start_of_turn>model\n'}}{% endif %}"
)
"""Gemma 2 instruct's template (raises on a system message or non-alternating roles)."""


@pytest.fixture(scope="module")
def echo() -> Iterator[EchoBackendHandle]:
    with start_echo_backend(tokens=2) as handle:
        yield handle


def _gateway(
    tmp: pytest.TempPathFactory,
    model: Path,
    echo: EchoBackendHandle,
    template: str,
    *overrides: str,
) -> Any:
    root = tmp.mktemp("gw")
    tokenizer = tokenizer_dir_with_template(model, root / "tokenizer", template)
    return run_gateway(
        root,
        model,
        [echo.url],
        f"gateway.tokenizer={tokenizer}",
        "gateway.sampling.mode=client",
        "gateway.sampling.default_max_tokens=2",
        *overrides,
    )


@pytest.fixture(scope="module")
def smol_gw(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, echo: EchoBackendHandle
) -> Iterator[Gateway]:
    with _gateway(tmp_path_factory, tiny_model_dir, echo, SMOLLM2_TEMPLATE) as gw:
        yield gw


@pytest.fixture(scope="module")
def gemma_gw(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, echo: EchoBackendHandle
) -> Iterator[Gateway]:
    with _gateway(tmp_path_factory, tiny_model_dir, echo, GEMMA2_TEMPLATE) as gw:
        yield gw


def _post(gw: Gateway, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gw.url + path, json=body, headers=AUTH, timeout=60)


PREFIX = "the model's chat template cannot render this conversation: "


def test_tool_round_with_null_content_is_served(smol_gw: Gateway) -> None:
    """openai-python sends the assistant tool-call turn back with `content: null`."""
    client = openai.OpenAI(base_url=smol_gw.v1, api_key=ADMIN_KEY, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL,
        tools=TOOLS,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    # Responses replays a function call and its output the same way.
    response = _post(
        smol_gw,
        "/v1/responses",
        {
            "model": MODEL,
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city": "Paris"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            ],
        },
    )
    assert response.status_code == 200, response.text


def test_status_reports_whether_tools_render(
    smol_gw: Gateway,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    echo: EchoBackendHandle,
) -> None:
    status = httpx.get(smol_gw.url + "/admin/status", headers=AUTH, timeout=30)
    assert status.status_code == 200, status.text
    assert status.json()["chat_template_renders_tools"] is False
    with _gateway(
        tmp_path_factory,
        tiny_model_dir,
        echo,
        SMOLLM2_TEMPLATE,
        "engine.chat_template=builtin:chatml-tools",
    ) as gw:
        assert gw.state.tokenizer.renders_tools
        status = httpx.get(gw.url + "/admin/status", headers=AUTH, timeout=30)
        assert status.json()["chat_template_renders_tools"] is True


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_template_refusal_is_an_openai_400(gemma_gw: Gateway, stream: bool) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ok = _post(
        gemma_gw,
        "/v1/chat/completions",
        {"model": MODEL, "messages": messages[1:], "stream": stream},
    )
    assert ok.status_code == 200, ok.text
    for path, body in (
        ("/v1/chat/completions", {"model": MODEL, "messages": messages, "stream": stream}),
        (
            "/v1/responses",
            {"model": MODEL, "instructions": "Be brief.", "input": "hi", "stream": stream},
        ),
    ):
        response = _post(gemma_gw, path, body)
        assert response.status_code == 400, (path, response.text)
        assert response.headers["content-type"].startswith("application/json")
        error = response.json()["error"]
        assert error == {
            "message": PREFIX + "TemplateError: System role not supported",
            "type": "invalid_request_error",
            "param": None,
            "code": "chat_template_error",
        }, path
    client = openai.OpenAI(base_url=gemma_gw.v1, api_key=ADMIN_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="System role not supported"):
        client.chat.completions.create(model=MODEL, messages=messages)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_template_refusal_is_an_anthropic_400(gemma_gw: Gateway, path: str) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 2,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "hi"}],
    }
    response = _post(gemma_gw, path, body)
    assert response.status_code == 400, response.text
    assert json.loads(response.text) == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": PREFIX + "TemplateError: System role not supported",
            "code": "chat_template_error",
        },
    }
    without_system = {k: v for k, v in body.items() if k != "system"}
    assert _post(gemma_gw, path, without_system).status_code == 200


def test_parser_settings_reach_the_served_tokenizer(
    smol_gw: Gateway,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    echo: EchoBackendHandle,
) -> None:
    """`gateway.tool_parser` / `gateway.reasoning_parser` override the parser the
    template would get (SmolLM2's renders no tools: the Hermes default)."""
    assert smol_gw.state.tokenizer.output_parser.name == "hermes+think"
    with _gateway(
        tmp_path_factory,
        tiny_model_dir,
        echo,
        SMOLLM2_TEMPLATE,
        "gateway.tool_parser=llama3_json",
        "gateway.reasoning_parser=none",
    ) as gw:
        assert gw.state.tokenizer.output_parser.name == "llama3_json+none"
        assert gw.state.tokenizer.think_close_id is None
