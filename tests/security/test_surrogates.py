"""N9: a lone UTF-16 surrogate (`\\ud800`..`\\udfff` without its pair: no character, no
store column or encoder takes it) is refused at the edge with 400 in the route's wire
shape, like a NUL, on every route and in any field (a conversation's text included);
a pair (an emoji as most JSON encoders write it) is text. The keep-alive connection
lives on after each refusal, and after a 500 on a framework route."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support.security_harness import STORES

ADMIN = {"authorization": "Bearer sk-test-admin", "content-type": "application/json"}
HIGH, LOW = "a\ud800b", "\udfff"


@pytest.fixture(scope="module", params=STORES)
def gw(request: pytest.FixtureRequest, serve_on: Callable[..., Any]) -> Iterator[Any]:
    lora = ("trainer.lora.rank=4", "trainer.lora.alpha=8")
    with serve_on(request.param, "gateway.sampling.default_max_tokens=2", *lora) as gateway:
        yield gateway


class Connection:
    """One keep-alive HTTP/1.1 connection that must stay the same socket throughout."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.http = http.client.HTTPConnection(host, int(port), timeout=60)
        self.http.connect()
        self.sock = self.http.sock

    def post(self, path: str, body: Any, method: str = "POST") -> tuple[int, Any]:
        # json.dumps escapes non-ASCII (`\ud800`), as a client's encoder does.
        payload = None if body is None else json.dumps(body)
        self.http.request(method, path, body=payload, headers=ADMIN)
        reply = self.http.getresponse()
        data = json.loads(reply.read())
        assert reply.getheader("connection") != "close"
        assert self.http.sock is self.sock, "the server closed the keep-alive connection"
        return reply.status, data


@pytest.fixture()
def conn(gw: Any) -> Iterator[Connection]:
    connection = Connection(gw.url)
    yield connection
    connection.http.close()


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "areal-policy", "max_tokens": 2, **extra} | {
        "messages": extra.get("messages", [{"role": "user", "content": "hi"}])
    }


def _anthropic(**extra: Any) -> dict[str, Any]:
    return {
        "model": "areal-policy",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
    } | extra


CASES = [
    ("/v1/chat/completions", _chat(stop=[HIGH])),
    ("/v1/chat/completions", _chat(stop=LOW)),
    ("/v1/chat/completions", {**_chat(), "model": HIGH}),
    ("/v1/chat/completions", _chat(metadata={"k": HIGH})),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": HIGH}])),
    ("/v1/chat/completions", _chat(user=LOW)),
    ("/v1/messages", _anthropic(stop_sequences=[HIGH])),
    ("/v1/messages", _anthropic(model=LOW)),
    ("/v1/messages", _anthropic(system=HIGH)),
    ("/v1/responses", {"model": "areal-policy", "input": "hi", "metadata": {"k": HIGH}}),
    ("/v1/responses", {"model": "areal-policy", "input": "hi", "user": LOW}),
    ("/v1/responses", {"model": HIGH, "input": "hi"}),
    ("/v1/responses", {"model": "areal-policy", "input": HIGH}),
    ("/admin/policies", {"name": "surr", "model_names": [HIGH]}),
    ("/admin/policies", {"name": "surr", "model_names": ["ok"], "lora": {"target_modules": [LOW]}}),
    ("/admin/policies", {"name": "surr", "roles": [HIGH]}),
    ("/admin/keys", {"name": HIGH}),
    ("/rl/sessions", {"metadata": {HIGH: 1}}),
    ("/rl/sessions", {"task_id": LOW}),
    ("/v1/rewards", {"group_id": "g", "value": 1, "id": HIGH}),
]


@pytest.mark.parametrize(("path", "body"), CASES)
def test_lone_surrogates_are_400_in_the_wire_shape(
    conn: Connection, path: str, body: dict[str, Any]
) -> None:
    status, reply = conn.post(path, body)
    assert status == 400, reply
    if path == "/v1/messages":  # Anthropic's shape
        assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    else:
        assert reply["error"]["type"] == "invalid_request_error", reply
        assert reply["error"]["code"] == "invalid_characters", reply
    assert "surrogate" in reply["error"]["message"], reply
    # The same connection serves the next request.
    assert conn.post("/rl/sessions", None, method="GET")[0] == 200


def test_a_surrogate_pair_is_text(conn: Connection, gw: Any) -> None:
    """An emoji outside the BMP, escaped as a pair (`\\ud83d\\ude00`), is served and
    stored whole, on every route that takes text."""
    emoji = "smile \U0001f600"
    status, reply = conn.post("/v1/chat/completions", _chat(stop=[emoji], metadata={"k": emoji}))
    assert status == 200, reply
    stored = gw.state.store.get_completion(reply["id"])
    assert stored is not None and stored.request_json["metadata"] == {"k": emoji}
    status, reply = conn.post("/admin/keys", {"name": emoji})
    assert status == 201 and reply["name"] == emoji, reply


def test_a_500_on_a_framework_route_keeps_the_connection(
    conn: Connection, gw: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug behind a framework route is a logged 500 in the OpenAI shape, and the
    client's keep-alive connection stays open (a failure the real store cannot be made
    to produce on demand: injected)."""

    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(gw.state.store, "list_sessions", broken)
    status, reply = conn.post("/rl/sessions", None, method="GET")
    assert status == 500 and reply["error"]["code"] == "internal_error", reply
    monkeypatch.undo()
    assert conn.post("/rl/sessions", None, method="GET")[0] == 200
