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
def gw(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
       engine_url: str) -> Iterator[Any]:
    from harness import run_gateway

    with run_gateway(tmp_path_factory.mktemp("hardening"), tiny_model_dir, [engine_url],
                     "gateway.default_max_tokens=2") as gateway:
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
    response = httpx.post(gw.url + path, content=_bodies(depth)[path], headers=AUTH,
                          timeout=60)
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
