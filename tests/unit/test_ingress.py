"""The one ingress (`gateway/ingress.py`): the body is read, bounded and checked there,
once, and no route gets a Starlette `Request` rebuilt from the ASGI scope."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest
from starlette.types import Message

from gateway.errors import OpenAIError
from gateway.ingress import check_body, json_object, read_body, refuse_declared

GATEWAY = Path(__file__).parents[2] / "gateway"


def test_no_starlette_request_is_built_in_the_gateway() -> None:
    """FastAPI builds the `Request` of its own routes; gateway code never makes one."""
    built = []
    for path in GATEWAY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "Request"
            ):
                built.append(f"{path.relative_to(GATEWAY)}:{node.lineno}")
    assert not built, built


def _receive(*chunks: bytes):
    messages: list[Message] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return receive


def test_body_is_bounded_as_it_arrives() -> None:
    assert asyncio.run(read_body(_receive(b"ab", b"cd"), 4)) == b"abcd"
    with pytest.raises(OpenAIError) as exc:
        asyncio.run(read_body(_receive(b"ab", b"cde"), 4))
    assert exc.value.status == 413 and exc.value.code == "request_too_large"
    assert asyncio.run(read_body(_receive(), 4)) is None  # the client left


def test_declared_length_is_refused_before_reading() -> None:
    scope = {"headers": [(b"content-length", b"5")]}
    assert refuse_declared(scope, 5) is None
    refused = refuse_declared(scope, 4)
    assert refused is not None and refused.status == 413


def test_body_checks() -> None:
    check_body(b'{"a": "x"}')  # nothing to refuse: never parsed
    check_body(b"not json \\u0000")  # not JSON: its route answers it
    with pytest.raises(OpenAIError) as exc:
        check_body(b'{"model": "a\\u0000"}')
    assert exc.value.code == "invalid_characters"
    body = {"messages": [{"content": "\x00"}]}
    check_body(b'{"messages": [{"content": "\\u0000"}]}', body, text_fields={"messages"})
    with pytest.raises(OpenAIError):
        check_body(b"a=%00", form=True)


def test_a_body_parsed_off_the_loop_is_the_same_and_lets_other_threads_run() -> None:
    """The off-loop parse (`yielding`) gives json's own result, and a thread beside it is not
    held for the whole parse (json's C parser keeps the GIL for a whole document)."""
    import json
    import threading
    import time

    sample = b'{"a": [1, -2, 3.5e3, 1e400, "x\\u00e9", null, true, {"b": {}}], "c": 12345678901234567890}'
    assert json_object(sample, yielding=True) == json.loads(sample)
    big = json.dumps({"messages": [{"role": "user", "content": ""}] * 600_000}).encode()
    worst = 0.0
    parser = threading.Thread(target=json_object, args=(big,), kwargs={"yielding": True})
    started = time.monotonic()
    parser.start()
    while parser.is_alive():
        before = time.monotonic()
        time.sleep(0.001)
        worst = max(worst, time.monotonic() - before)
    parse = time.monotonic() - started
    # Held for the whole parse, the sleeper would wait about `parse`; given the GIL at
    # every switch interval (5 ms), a small fraction of it (half leaves room for a
    # loaded machine's scheduling).
    assert worst < parse / 2, (worst, parse)
