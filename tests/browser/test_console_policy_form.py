"""The console's form to create a policy at runtime (`/console/policies/new`), in real
headless Chromium against a real gateway and engine: a policy created from the form is
in the store and the API's list at once; a taken name and a bad rank are refused on the
form with the API's message and status (the values kept); a POST without the CSRF token
and a signed-out browser are refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.harness import ADMIN_KEY, Gateway, run_gateway

from engine.testing import start_engine_in_thread

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
FORM = "/console/policies/new"


@pytest.fixture(scope="module")
def policy_gateway(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Gateway]:
    with (
        start_engine_in_thread(tiny_model_dir) as engine_url,
        run_gateway(
            tmp_path_factory.mktemp("console-policies"),
            tiny_model_dir,
            [engine_url],
            "trainer.lora.rank=4",
            "policies=[{name: solver, model_names: [solver-model]}]",
        ) as gw,
    ):
        yield gw


@pytest.fixture()
def form_page(browser: object) -> Iterator[object]:
    """A fresh context and page; fails on script errors, and on any failed response but
    the refusals this test asks for (the form's 400/409, the login's 401)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})  # type: ignore[attr-defined]
    context.set_default_timeout(15_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    failed: list[str] = []
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    yield page
    context.close()
    assert errors == []
    expected = ("400 ", "409 ")
    assert [f for f in failed if not (f.startswith(expected) and f.endswith(FORM))] == []


def _sign_in(page, base: str) -> None:  # noqa: ANN001
    page.goto(f"{base}{FORM}")
    assert "/console/login" in page.url  # signed out: the login first, then back here
    page.fill("#admin_key", ADMIN_KEY)
    page.click("button[type=submit]")
    page.wait_for_selector("#policy-name")


def test_create_a_policy_from_the_console(form_page, policy_gateway, tmp_path) -> None:  # noqa: ANN001
    page, gw, base = form_page, policy_gateway, policy_gateway.url
    _sign_in(page, base)
    assert page.inner_text("h1") == "New policy"
    page.fill("#policy-name", "verifier")
    page.fill("#policy-rank", "2")
    page.fill("#policy-targets", "q_proj, v_proj")
    page.fill("#policy-models", "verifier-model, judge")
    page.click("text=Create policy")
    page.wait_for_selector("#policy-created")
    assert "verifier" in page.inner_text("#policy-created")
    page.screenshot(path=str(tmp_path / "policy-created.png"), full_page=True)
    stored = {p.name: p for p in gw.state.store.policies.list_policies()}
    assert stored["verifier"].lora is not None
    assert stored["verifier"].lora["rank"] == 2
    assert stored["verifier"].lora["alpha"] == 16.0  # trainer.lora's, not given
    assert stored["verifier"].lora["target_modules"] == ["q_proj", "v_proj"]
    assert stored["verifier"].model_names == ("judge", "verifier-model")
    listed = httpx.get(f"{base}/admin/policies", headers=ADMIN, timeout=30).json()["data"]
    assert [p["name"] for p in listed] == ["default", "solver", "verifier"]

    # Taken (the config's name), then a bad rank: the API's words, the values kept.
    for name, rank, status, words in [
        ("solver", "", 409, "exists already (the config)"),
        ("critic", "zero", 400, "not a number"),
        ("critic", "0", 400, "lora.rank"),
        ("critic", "", 409, "already picks policy 'solver'"),
    ]:
        page.fill("#policy-name", name)
        page.fill("#policy-rank", rank)
        page.fill("#policy-models", "solver-model" if status == 409 and name == "critic" else "")
        with page.expect_response(f"**{FORM}") as answered:
            page.click("text=Create policy")
        assert answered.value.status == status
        assert words in page.inner_text("#policy-error")
        assert page.input_value("#policy-name") == name
    page.screenshot(path=str(tmp_path / "policy-refused.png"), full_page=True)
    assert "critic" not in {p.name for p in gw.state.store.policies.list_policies()}


def test_the_form_needs_the_admin_and_its_csrf_token(policy_gateway) -> None:  # noqa: ANN001
    base = policy_gateway.url
    # No console cookie: the form is not shown and the POST creates nothing.
    page = httpx.get(f"{base}{FORM}", timeout=30, follow_redirects=False)
    assert page.status_code in (302, 303, 307, 401)
    anonymous = httpx.post(f"{base}{FORM}", data={"name": "sneaky"}, timeout=30)
    assert anonymous.status_code in (302, 303, 401, 403)
    # Signed in, but without the CSRF token: 403.
    http = httpx.Client(base_url=base, timeout=30)
    login = http.get("/console/login")
    token = login.text.split('name="csrf_token" value="')[1].split('"')[0]
    signed = http.post("/console/login", data={"admin_key": ADMIN_KEY, "csrf_token": token})
    assert signed.status_code in (200, 303), signed.text[:500]
    assert http.get(FORM).status_code == 200
    forged = http.post(FORM, data={"name": "sneaky"})
    assert forged.status_code == 403
    assert "sneaky" not in {p.name for p in policy_gateway.state.store.policies.list_policies()}
