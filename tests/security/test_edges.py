"""Integers and strings at the edges: each answered 400 in the OpenAI shape, never a 500,
and the connection stays usable after."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sec_harness import serve_gateway

ADMIN = {"authorization": "Bearer sk-test-admin"}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
       sec_engine_url: str) -> Iterator[Any]:
    with serve_gateway(tmp_path_factory.mktemp("edges"), tiny_model_dir, [sec_engine_url],
                       "gateway.default_max_tokens=2") as gateway:
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
def test_huge_offsets_are_400_and_the_connection_lives(http: httpx.Client, path: str,
                                                       offset: int) -> None:
    _is_400(http.get(path, params={"offset": offset}))
    _is_400(http.get(path, params={"limit": offset}))
    assert http.get(path, params={"offset": 1_000_000_000}).status_code == 200
    assert http.get(path).status_code == 200  # same keep-alive connection


def test_console_page_beyond_any_offset_is_an_empty_page(gw: Any) -> None:
    import re

    with httpx.Client(base_url=gw.url, timeout=30) as console:
        page = console.get("/console/login")
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
        assert console.post("/console/login", data={
            "csrf_token": csrf, "admin_key": "sk-test-admin"}).status_code == 303
        assert console.get("/console/sessions", params={"page": 2**70}).status_code == 200
