"""Failure paths of the gateway with real clients over loopback: 401 for missing or bad
keys, 404 `model_not_found`, 400 `invalid_request_error` naming `param` for malformed
bodies (and fuzzed ones: never a 500, never HTML), 400 `context_length_exceeded`, 503 +
retry-after when the backend is down or stuck paused, and a request held by a paused
backend completing once it continues."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

if TYPE_CHECKING:
    from support.harness import Gateway

MODEL = "areal-policy"
ADMIN_KEY = "sk-test-admin"
"""The admin key every test gateway is configured with (checked in `_admin`)."""
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
Factory = Callable[..., AbstractContextManager["Gateway"]]


def _admin(gw: Gateway) -> Gateway:
    assert gw.config.gateway.auth.admin_key.get_secret_value() == ADMIN_KEY
    return gw


@pytest.fixture()
def short_gw(
    tmp_path: Path, tiny_model_dir: Path, engine_url: str, gateway_factory: Factory
) -> Iterator[Gateway]:
    """A gateway with a 64-token context and 2-token default replies (fuzzing is fast)."""
    with gateway_factory(
        tmp_path,
        tiny_model_dir,
        [engine_url],
        "engine.context_length=64",
        "gateway.sampling.default_max_tokens=2",
        "gateway.sampling.mode=client",
    ) as gw:
        yield _admin(gw)


def _post(
    gw: Gateway, path: str, body: Any, headers: dict[str, str] | None = None
) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        gw.url + path,
        content=content,
        timeout=60,
        headers={"content-type": "application/json", **(AUTH if headers is None else headers)},
    )


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error object of a JSON error response with `status`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers.get("x-request-id")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# ------------------------------------------------------------------ auth and model


def test_missing_or_bad_key_is_401(gateway: Gateway) -> None:
    _admin(gateway)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for headers in (
        {},
        {"Authorization": "Bearer"},
        {"Authorization": "Basic abc"},
        {"Authorization": "Bearer sk-wrong"},
    ):
        error = _error(_post(gateway, "/v1/chat/completions", body, headers), 401)
        assert error["code"] == "invalid_api_key"
        assert error["type"] == "invalid_request_error"
    client = openai.OpenAI(base_url=gateway.v1, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        client.chat.completions.create(model=MODEL, messages=body["messages"])
    assert err.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    with pytest.raises(openai.AuthenticationError):
        client.responses.create(model=MODEL, input="hi")


def test_unknown_model_is_404_in_strict_mode(
    tmp_path: Path, tiny_model_dir: Path, engine_url: str, gateway_factory: Factory
) -> None:
    with gateway_factory(
        tmp_path, tiny_model_dir, [engine_url], "gateway.model_names=[gpt-4o-mini]"
    ) as gateway:
        _unknown_model_is_404(_admin(gateway))


def _unknown_model_is_404(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=gateway.v1, api_key=ADMIN_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found" and err.value.param == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(
            model="gpt-9", stream=True, messages=[{"role": "user", "content": "x"}]
        )
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="gpt-9", input="x")
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-9")
    assert err.value.code == "model_not_found"
    assert err.value.body["message"].endswith("serves `areal-policy`, `gpt-4o-mini`.")


def test_unknown_paths_and_methods_answer_json(gateway: Gateway) -> None:
    assert _error(httpx.get(gateway.url + "/v1/nothing-here", headers=AUTH), 404)
    assert _error(httpx.get(gateway.url + "/v1/chat/completions", headers=AUTH), 405)


# ------------------------------------------------------------------ malformed bodies

_MESSAGES = [{"role": "user", "content": "hi"}]
CHAT_CASES: list[tuple[Any, str | None]] = [
    (b"{", None),
    (b"", None),
    (b"[1, 2]", None),
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": 5}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": ["hi"]}, "messages[0]"),
    ({"model": MODEL, "messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        {
            "model": MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ],
        },
        "messages[0].content",
    ),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content",
    ),
    ({"model": MODEL, "messages": [{"role": "user", "content": [5]}]}, "messages[0].content"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": ["text"]}]}]},
        "messages[0].content",
    ),
    (
        {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
        "messages[0].tool_calls[0].function",
    ),
    ({"messages": _MESSAGES}, "model"),
    ({"model": 5, "messages": _MESSAGES}, "model"),
    ({"model": MODEL, "messages": _MESSAGES, "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "messages": _MESSAGES, "temperature": 3}, "temperature"),
    ({"model": MODEL, "messages": _MESSAGES, "n": 0}, "n"),
    ({"model": MODEL, "messages": _MESSAGES, "functions": [{"description": "x"}]}, "functions"),
    ({"model": MODEL, "messages": _MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": _MESSAGES, "max_completion_tokens": -3}, "max_completion_tokens"),
    ({"model": MODEL, "messages": _MESSAGES, "top_logprobs": 50}, "top_logprobs"),
    ({"model": MODEL, "messages": _MESSAGES, "stop": 5}, "stop"),
    ({"model": MODEL, "messages": _MESSAGES, "tools": [{"type": "web_search"}]}, "tools"),
    ({"model": MODEL, "messages": _MESSAGES, "tools": {"type": "function"}}, "tools"),
    ({"model": MODEL, "messages": _MESSAGES, "tool_choice": "sometimes"}, "tool_choice"),
    ({"model": MODEL, "messages": _MESSAGES, "stream_options": 3}, "stream_options"),
    ({"model": MODEL, "messages": _MESSAGES, "seed": 2**70}, "seed"),
    ({"model": MODEL, "messages": _MESSAGES, "top_k": -5}, "top_k"),
    (
        b'{"model": "areal-policy", "messages": [{"role": "user", "content": "\\ud800"}]}',
        "messages",
    ),
]
RESPONSES_CASES: list[tuple[Any, str | None]] = [
    (b"not json", None),
    ({"input": "hi"}, "model"),
    ({"model": MODEL, "input": 5}, "input"),
    ({"model": MODEL, "input": [5]}, "input"),
    ({"model": MODEL, "input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"model": MODEL, "input": [{"role": "user", "content": [5]}]}, "input[0].content[0]"),
    (
        {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        "input[0].content[0]",
    ),
    ({"model": MODEL, "input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"model": MODEL, "input": [{"role": ["user"], "content": "x"}]}, "input[0].role"),
    (
        {
            "model": MODEL,
            "input": [{"type": "function_call_output", "call_id": "c", "output": {"x": 1}}],
        },
        "input[0].output",
    ),
    ({"model": MODEL, "input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
    (
        {"model": MODEL, "input": [{"type": "function_call_output", "output": "5"}]},
        "input[0].call_id",
    ),
    ({"model": MODEL, "input": [{"type": "web_search_call"}]}, "input[0]"),
    ({"model": MODEL, "input": "hi", "tools": [{"type": "namespace", "name": "n"}]}, "tools"),
    ({"model": MODEL, "input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"model": MODEL, "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": MODEL, "input": []}, "input"),
    ({"model": MODEL, "input": [{"type": "reasoning", "summary": 5}]}, "input[0].summary"),
]


@pytest.mark.parametrize(("body", "param"), CHAT_CASES)
def test_malformed_chat_body_is_400(short_gw: Gateway, body: Any, param: str | None) -> None:
    error = _error(_post(short_gw, "/v1/chat/completions", body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize(("body", "param"), RESPONSES_CASES)
def test_malformed_responses_body_is_400(short_gw: Gateway, body: Any, param: str | None) -> None:
    error = _error(_post(short_gw, "/v1/responses", body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_openai_client_maps_400(short_gw: Gateway) -> None:
    client = openai.OpenAI(base_url=short_gw.v1, api_key=ADMIN_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=_MESSAGES, n=0)
    assert err.value.param == "n" and err.value.type == "invalid_request_error"


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["int", "float", "str", "bool", "none"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, -1, 1, 7, 2**31, -(2**63), 10**30])
    if kind == "float":
        return rng.choice([0.5, -1e308, 1e308, 2.5])
    if kind == "str":
        return rng.choice(
            [
                "",
                "user",
                "assistant",
                "tool",
                "function",
                "text",
                "auto",
                "\x00",
                "é" * 3,
                "<|im_end|>",
                "{",
                MODEL,
                "system",
            ]
        )
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = [
        "role",
        "content",
        "type",
        "text",
        "name",
        "arguments",
        "function",
        "tool_calls",
        "tool_call_id",
        "call_id",
        "output",
        "id",
        "status",
        "include_usage",
        "x",
    ]
    return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _first_item(body: dict[str, Any], field: str) -> dict[str, Any] | None:
    items = body.get(field)
    return items[0] if isinstance(items, list) and items and isinstance(items[0], dict) else None


def _mutate(rng: random.Random, body: dict[str, Any]) -> dict[str, Any]:
    """`body` with a few fields replaced by random values, dropped, or added."""
    body = json.loads(json.dumps(body))
    fields = [
        "model",
        "messages",
        "input",
        "tools",
        "tool_choice",
        "stop",
        "n",
        "stream",
        "max_tokens",
        "temperature",
        "top_p",
        "logprobs",
        "top_logprobs",
        "seed",
        "stream_options",
        "instructions",
        "metadata",
        "functions",
        "function_call",
        "max_output_tokens",
        "include",
        "text",
        "response_format",
    ]
    for _ in range(rng.randint(1, 3)):
        action = rng.random()
        field = rng.choice(fields)
        if action < 0.15:
            body.pop(field, None)
        elif action < 0.4 and _first_item(body, "messages") is not None:
            body["messages"][0][rng.choice(["role", "content", "tool_calls", "name"])] = (
                _random_value(rng)
            )
        elif action < 0.55 and _first_item(body, "input") is not None:
            body["input"][0][rng.choice(["role", "content", "type", "call_id"])] = _random_value(
                rng
            )
        else:
            body[field] = _random_value(rng)
    return body


def test_fuzzed_bodies_never_500_or_html(short_gw: Gateway) -> None:
    rng = random.Random(20240607)
    chat_seed = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    responses_seed = {
        "model": MODEL,
        "input": [{"role": "user", "content": "hi"}],
        "max_output_tokens": 2,
    }
    statuses: dict[int, int] = {}
    for i in range(80):
        path, seed = (
            ("/v1/chat/completions", chat_seed) if i % 2 else ("/v1/responses", responses_seed)
        )
        body = _mutate(rng, seed)
        response = _post(short_gw, path, body)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code in (200, 400, 404), (path, body, response.text)
        ctype = response.headers["content-type"]
        if response.status_code != 200:
            assert _error(response, response.status_code)
        else:
            assert ctype.startswith(("application/json", "text/event-stream")), ctype
    for raw in (
        b"\xff\xfe",
        b"null",
        b"1e999",
        b'{"model": "' + b"a" * 10_000 + b'"}',
        b'{"messages": [' * 50 + b"]" * 50 + b"}",
    ):
        response = _post(short_gw, "/v1/chat/completions", raw)
        assert response.status_code in (400, 404), response.text
        assert _error(response, response.status_code)
    assert statuses.get(400, 0) > 15 and statuses.get(200, 0) > 5, statuses


# ------------------------------------------------------------------ context length


def test_prompt_too_long_is_context_length_exceeded(short_gw: Gateway) -> None:
    client = openai.OpenAI(base_url=short_gw.v1, api_key=ADMIN_KEY, max_retries=0)
    long = [{"role": "user", "content": "apples and numbers " * 40}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=long, stream=stream)
        assert err.value.code == "context_length_exceeded"
        assert err.value.param == "messages"
        assert "maximum context length is 64 tokens" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=long[0]["content"])
    assert err.value.code == "context_length_exceeded" and err.value.param == "input"


def test_reply_budget_past_the_context_is_400_on_chat(short_gw: Gateway) -> None:
    """OpenAI (and vLLM, SGLang) refuse a `max_tokens` that does not fit beside the
    prompt; the gateway used to cut it silently. The gateway's own default is still cut,
    and the Anthropic route cuts (Claude Code asks 32000 whatever the model)."""
    client = openai.OpenAI(base_url=short_gw.v1, api_key=ADMIN_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=_MESSAGES, max_tokens=1000)
    prompt = err.value.body["message"].split("(", 1)[1].split(" ", 1)[0]
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    assert err.value.body["message"] == (
        f"This model's maximum context length is 64 tokens. However, you requested "
        f"{int(prompt) + 1000} tokens ({prompt} in the messages, 1000 in the completion). "
        "Please reduce the length of the messages or completion."
    )
    assert (
        _error(
            _post(
                short_gw,
                "/v1/chat/completions",
                {"model": MODEL, "messages": _MESSAGES, "max_tokens": 10**9},
            ),
            400,
        )["code"]
        == "context_length_exceeded"
    )
    fits = client.chat.completions.create(
        model=MODEL, messages=_MESSAGES, temperature=0, max_tokens=64 - int(prompt)
    )
    assert fits.usage.total_tokens == 64 and fits.choices[0].finish_reason == "length"
    cut = httpx.post(
        short_gw.url + "/v1/messages",
        timeout=60,
        headers=AUTH,
        # greedy, as `fits` above: sampled at T=1 the tiny model may end before the budget
        json={"model": MODEL, "max_tokens": 32000, "messages": _MESSAGES, "temperature": 0},
    )
    assert cut.status_code == 200, cut.text
    assert cut.json()["stop_reason"] == "max_tokens"


def test_error_texts_say_what_to_fix(gateway: Gateway) -> None:
    """The same words for the same mistake on every route: JSON errors with line and
    column, no pydantic "Value error," prefix, a missing key said as missing, and an
    unknown route named."""
    chat = _error(_post(gateway, "/v1/chat/completions", b'{"model": '), 400)["message"]
    assert chat == (
        "the request body is not valid JSON: Expecting value: line 1 column 11 (char 10)"
    )
    for path in ("/v1/rewards", "/rl/sessions"):
        assert _error(_post(gateway, path, b'{"model": '), 400)["message"] == chat, path
    both = _error(_post(gateway, "/v1/rewards", {"value": 1}), 400)["message"]
    assert both == "name exactly one target: completion_id, session_id or group_id (at body)"
    missing = _error(_post(gateway, "/v1/chat/completions", {}, headers={}), 401)
    assert missing["message"].startswith(
        "You didn't provide an API key. Send it in an Authorization header (Authorization: Bearer"
    )
    assert "none" not in missing["message"]
    wrong = _error(
        _post(gateway, "/v1/chat/completions", {}, {"Authorization": "Bearer sk-wr"}), 401
    )
    assert wrong["message"].startswith("Incorrect API key provided: sk-wr…")
    unknown = _error(httpx.get(gateway.url + "/v1/nothing-here", headers=AUTH), 404)
    assert unknown["message"] == (
        "Invalid URL (GET /v1/nothing-here): this gateway has no "
        "such route; the OpenAI routes are under /v1 (all of them "
        "at /docs)"
    )
    method = _error(httpx.get(gateway.url + "/v1/rewards", headers=AUTH), 405)
    assert method["message"] == "Invalid method (GET /v1/rewards): /v1/rewards does not take GET"


# ------------------------------------------------------------------ backend failures


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_backend_down_is_503_with_retry_after(
    tmp_path: Path, tiny_model_dir: Path, gateway_factory: Factory
) -> None:
    with gateway_factory(
        tmp_path,
        tiny_model_dir,
        [f"http://127.0.0.1:{_closed_port()}"],
        "gateway.router.backend_unavailable_deadline_s=0.5",
    ) as gw:
        _admin(gw)
        body = {"model": MODEL, "messages": _MESSAGES, "max_tokens": 2}
        for path, extra in (
            ("/v1/chat/completions", {}),
            ("/v1/chat/completions", {"stream": True}),
            ("/v1/responses", {"input": "hi", "stream": True}),
        ):
            response = _post(gw, path, {**body, **extra})
            error = _error(response, 503)
            assert error["code"] == "backend_unavailable" and error["type"] == "server_error"
            assert int(response.headers["retry-after"]) >= 1
        client = openai.OpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(model=MODEL, messages=_MESSAGES)
        assert err.value.status_code == 503


def _engine_call(engine_url: str, path: str, body: dict[str, Any] | None = None) -> None:
    httpx.post(engine_url + path, json=body or {}, timeout=30).raise_for_status()


def test_paused_backend_holds_request_until_continue(
    tmp_path: Path, tiny_model_dir: Path, engine_url: str, gateway_factory: Factory
) -> None:
    """A paused backend (a weight swap) is ridden out: the request waits past
    `backend_unavailable_deadline_s` (which bounds waiting for an unreachable backend)
    and completes once generation continues."""
    with gateway_factory(
        tmp_path, tiny_model_dir, [engine_url], "gateway.router.backend_unavailable_deadline_s=0.3"
    ) as gw:
        _admin(gw)
        client = openai.OpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0)
        result: dict[str, Any] = {}

        def call() -> None:
            result["completion"] = client.chat.completions.create(
                model=MODEL, messages=_MESSAGES, max_tokens=3
            )

        _engine_call(engine_url, "/pause_generation", {"mode": "abort"})
        try:
            worker = threading.Thread(target=call)
            worker.start()
            time.sleep(1.5)
            assert worker.is_alive(), "the request should wait while the backend is paused"
        finally:
            _engine_call(engine_url, "/continue_generation")
        worker.join(timeout=60)
        completion = result["completion"]
        assert completion.usage.completion_tokens == 3
        assert gw.state.store.get_completion(completion.id) is not None


def test_backend_paused_past_request_timeout_is_503(
    tmp_path: Path, tiny_model_dir: Path, engine_url: str, gateway_factory: Factory
) -> None:
    with gateway_factory(
        tmp_path, tiny_model_dir, [engine_url], "gateway.router.request_timeout_s=1.0"
    ) as gw:
        _admin(gw)
        _engine_call(engine_url, "/pause_generation", {"mode": "abort"})
        try:
            for stream in (False, True):
                response = _post(
                    gw,
                    "/v1/chat/completions",
                    {"model": MODEL, "messages": _MESSAGES, "max_tokens": 2, "stream": stream},
                )
                assert _error(response, 503)["code"] == "backend_unavailable"
                assert response.headers["retry-after"]
        finally:
            _engine_call(engine_url, "/continue_generation")


def test_oversized_bodies_are_413_before_they_are_read_whole(
    tmp_path: Path, tiny_model_dir: Path, engine_url: str, gateway_factory: Factory
) -> None:
    """Declared (content-length) and undeclared (chunked) bodies past the limit both get
    413 `request_too_large` in the OpenAI shape, on the hot routes and the others."""
    with gateway_factory(
        tmp_path, tiny_model_dir, [engine_url], "gateway.limits.max_request_bytes=4096"
    ) as gw:
        gw = _admin(gw)
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
        for path in ("/v1/chat/completions", "/v1/responses", "/v1/rewards"):
            error = _error(_post(gw, path, big), 413)
            assert error["code"] == "request_too_large", path

        def chunked() -> Iterator[bytes]:  # no content-length: counted as it arrives
            yield b'{"model": "areal-policy", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}]}'

        response = httpx.post(
            gw.url + "/v1/chat/completions",
            content=chunked(),
            timeout=60,
            headers={"content-type": "application/json", **AUTH},
        )
        assert "content-length" not in response.request.headers
        assert _error(response, 413)["code"] == "request_too_large"
        small = {"model": MODEL, "messages": _MESSAGES, "max_tokens": 2}
        assert _post(gw, "/v1/chat/completions", small).status_code == 200
