"""Any model name works: an agent written for another provider keeps its own model name
(`gpt-4o-mini`, `default`) and is served by the policy; replies echo the name, the store
records it next to the policy's, `/v1/models` lists the policy and its aliases, and
strict mode (`gateway.model_names`) refuses other names with OpenAI's 404; the console's
session page shows the name a client used."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from areal_service.store import TrajectoryStore
from areal_service.types import CompletionRecord

ADMIN_KEY = "sk-test-admin"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
POLICY = "areal-policy"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gw(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, engine_url: str
) -> Iterator[Any]:
    from support.harness import run_gateway

    with run_gateway(tmp_path_factory.mktemp("names"), tiny_model_dir, [engine_url]) as gateway:
        yield gateway


def _client(gw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0)


def _record(
    gw: Any, completions_of: Callable[[TrajectoryStore], list[CompletionRecord]], completion_id: str
) -> CompletionRecord:
    return next(r for r in completions_of(gw.state.store) if r.id == completion_id)


@pytest.mark.parametrize("name", ["gpt-4o-mini", "default", "qwen2.5-7b-instruct"])
def test_any_model_name_is_served_echoed_and_recorded(
    gw: Any, completions_of: Callable[[TrajectoryStore], list[CompletionRecord]], name: str
) -> None:
    client = _client(gw)
    chat = client.chat.completions.create(model=name, messages=USER, max_tokens=2)
    assert chat.model == name
    stream = client.chat.completions.create(model=name, messages=USER, max_tokens=2, stream=True)
    chunks = list(stream)
    assert {c.model for c in chunks} == {name}
    response = client.responses.create(model=name, input="hi", max_output_tokens=2)
    assert response.model == name
    for completion_id in (chat.id, chunks[0].id, response.id):
        record = _record(gw, completions_of, completion_id)
        assert record.requested_model == name and record.model == POLICY


def test_models_lists_the_policy(gw: Any) -> None:
    models = _client(gw).models.list()
    assert [m.id for m in models.data] == [POLICY]


@pytest.fixture()
def strict_gw(
    tmp_path: Path,
    tiny_model_dir: Path,
    engine_url: str,
    gateway_factory: Callable[..., AbstractContextManager[Any]],
) -> Iterator[Any]:
    with gateway_factory(
        tmp_path, tiny_model_dir, [engine_url], "gateway.model_names=[gpt-4o-mini, default]"
    ) as gateway:
        yield gateway


def test_strict_mode_serves_aliases_and_refuses_the_rest(strict_gw: Any) -> None:
    client = _client(strict_gw)
    assert [m.id for m in client.models.list().data] == [POLICY, "gpt-4o-mini", "default"]
    for name in (POLICY, "gpt-4o-mini", "default"):
        assert client.chat.completions.create(model=name, messages=USER, max_tokens=1).model == name
        assert client.models.retrieve(name).id == name
    assert (
        client.responses.create(model="default", input="hi", max_output_tokens=1).model == "default"
    )
    for call in (
        lambda: client.chat.completions.create(model="gpt-4o", messages=USER),
        lambda: client.responses.create(model="gpt-4o", input="hi"),
        lambda: client.models.retrieve("gpt-4o"),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.code == "model_not_found" and err.value.param == "model"
        assert err.value.type == "invalid_request_error"


def test_console_shows_the_name_the_client_used(gw: Any) -> None:
    started = httpx.post(gw.url + "/rl/sessions", json={}, headers=AUTH)
    session = started.json()
    client = openai.OpenAI(base_url=gw.v1, api_key=session["api_key"], max_retries=0)
    client.chat.completions.create(model="gpt-4o-mini", messages=USER, max_tokens=1)
    console = httpx.Client(base_url=gw.url, timeout=60)
    login = console.get("/console/login")
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', login.text)
    assert csrf is not None
    console.post("/console/login", data={"csrf_token": csrf.group(1), "admin_key": ADMIN_KEY})
    page = console.get(f"/console/sessions/{session['session_id']}")
    assert page.status_code == 200
    assert f'{POLICY} (asked as <span class="mono requested-model">gpt-4o-mini</span>)' in page.text


@pytest.mark.parametrize("name", ["gpt-4o-mini", "default"])
def test_langchain_agent_keeps_its_model_name(
    gw: Any, completions_of: Callable[[TrajectoryStore], list[CompletionRecord]], name: str
) -> None:
    """LangChain's `ChatOpenAI`, with tools bound, as an author writes it for OpenAI."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: float, b: float) -> float:
        """Add two numbers."""
        return a + b

    llm = ChatOpenAI(
        model=name, base_url=gw.v1, api_key=ADMIN_KEY, max_tokens=4, max_retries=0
    ).bind_tools([add])
    reply = llm.invoke("what is 2 + 3?")
    assert reply.response_metadata["model_name"] == name
    record = _record(gw, completions_of, reply.response_metadata["id"])
    assert record.requested_model == name and record.model == POLICY
