"""Issue 37, N7 and N4's caps: nothing capped runtime policies or their adapters.

- N7: the console form accepted `alpha=inf` (stored as `Infinity` on SQLite: a NaN from
  the first step; a 500 on PostgreSQL) and the API `alpha: 1e308`. Now both are 400
  `invalid_lora`, `1e308` because it is over `policy_caps.max_lora_alpha`.
- N4: rank 512 on every module was accepted (an adapter larger than the base model), and
  any number of policies could be created. Now rank is capped by
  `policy_caps.max_lora_rank` and the count of named policies by
  `policy_caps.max_policies` (409 `too_many_policies`).

Each attack over HTTP on loopback, on SQLite and PostgreSQL."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from support.security_harness import STORES

ADMIN_KEY = "sk-test-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
FORM = "/console/policies/new"


@pytest.fixture(scope="module", params=STORES)
def gw(request: pytest.FixtureRequest, serve_on: Callable[..., Any]) -> Iterator[Any]:
    with serve_on(
        request.param,
        "default_policy.lora.rank=4",
        "policy_caps.max_policies=2",
        "policy_caps.max_lora_rank=16",
        "policies=[{name: solver, model_names: [solver-model]}]",
    ) as gateway:
        yield gateway


def _create(gw: Any, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gw.url + "/admin/policies", headers=ADMIN, json=body, timeout=30)


def _names(gw: Any) -> list[str]:
    listed = httpx.get(gw.url + "/admin/policies", headers=ADMIN, timeout=30).json()
    return [p["name"] for p in listed["data"]]


def _console(gw: Any) -> httpx.Client:
    """An httpx client signed in to the console."""
    http = httpx.Client(base_url=gw.url, timeout=30)  # closed by the caller
    page = http.get("/console/login")
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
    assert http.post(
        "/console/login", data={"csrf_token": csrf, "admin_key": ADMIN_KEY}
    ).status_code in (302, 303)
    return http


def test_n7_alpha_must_be_finite_and_capped(gw: Any) -> None:
    for alpha in (1e308, 1e4):
        refused = _create(gw, {"name": "huge", "lora": {"alpha": alpha}})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "invalid_lora" and error["param"] == "lora.alpha", error
        assert "policy_caps.max_lora_alpha" in error["message"]
    http = _console(gw)
    try:
        form = http.get(FORM)
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', form.text).group(1)  # type: ignore[union-attr]
        for alpha in ("inf", "nan", "-inf", "1e308"):
            posted = http.post(FORM, data={"csrf_token": csrf, "name": "huge", "alpha": alpha})
            assert posted.status_code == 400, (alpha, posted.status_code)
            assert "lora.alpha" in posted.text
    finally:
        http.close()
    assert "huge" not in _names(gw)


def test_n4_rank_is_capped(gw: Any) -> None:
    refused = _create(gw, {"name": "wide", "lora": {"rank": 512}})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "invalid_lora" and error["param"] == "lora.rank", error
    assert "policy_caps.max_lora_rank" in error["message"]
    assert "wide" not in _names(gw)


def test_n4_the_number_of_policies_is_capped(gw: Any) -> None:
    # The config's `solver` and one runtime policy make the cap of 2.
    fits = _create(gw, {"name": "second", "lora": {"rank": 16}})
    assert fits.status_code == 201, fits.text
    over = _create(gw, {"name": "third"})
    assert over.status_code == 409, over.text
    error = over.json()["error"]
    assert error["code"] == "too_many_policies", error
    assert "policy_caps.max_policies" in error["message"]
    assert _names(gw) == ["default", "solver", "second"]
