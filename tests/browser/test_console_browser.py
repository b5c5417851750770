"""The admin console in real headless Chromium: sign in, create and revoke a key, read a
session recorded through the real gateway token by token, and see the training curves
drawn. Screenshots land in the test's tmp dir (and docs/ with AREAL_SAVE_SCREENSHOTS=1)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import httpx
import openai
import pytest
from support.harness import ADMIN_KEY

from areal_service.types import TrainStepRecord, WeightVersionRecord

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def sign_in(page, base_url: str, key: str = ADMIN_KEY) -> None:
    page.goto(f"{base_url}/console")
    assert "/console/login" in page.url
    page.fill("#admin_key", key)
    page.click("button[type=submit]")


def record_episode(gw, task_id: str, reward: float) -> tuple[str, str]:
    """An episode through the real gateway: a tool round trip in the request, the model's
    reply, a reward that ends the session. Returns (session id, completion id)."""
    http = httpx.Client(base_url=gw.url, timeout=60)
    started = http.post("/rl/sessions", json={"task_id": task_id}, headers=ADMIN).json()
    client = openai.OpenAI(base_url=gw.v1, api_key=started["api_key"], max_retries=0)
    reply = client.chat.completions.create(
        model=gw.config.gateway.model_name,
        max_tokens=12,
        tools=TOOLS,
        messages=[
            {"role": "system", "content": "You are a calculator."},
            {"role": "user", "content": "What is 2 + 3?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        ],
    )
    posted = http.post(
        "/v1/rewards",
        json={"session_id": started["session_id"], "value": reward, "end_session": True},
        headers={"authorization": f"Bearer {started['api_key']}"},
    )
    assert posted.status_code == 201, posted.text
    return started["session_id"], reply.id


def seed_training(gw, checkpoint: Path, steps: int = 12) -> None:
    """Train steps and weight versions as the trainer records them; every version points
    at `checkpoint` (the served model), so the gateway's weight syncer really swaps to the
    last one and records its own timings on it."""
    store = gw.state.store
    for step in range(1, steps + 1):
        store.add_train_step(
            TrainStepRecord(
                step,
                step,
                {
                    "task_reward": 0.2 + 0.6 * (1 - math.exp(-step / 4)),
                    "loss": -0.05 / step,
                    "approx_kl": 0.01 * step,
                    "clip_ratio": 0.02,
                    "importance_weight": 1.0 + 0.01 * step,
                    "entropy": 6.4 - 0.1 * step,
                    "staleness_mean": 0.5,
                    "staleness_max": 1.0,
                    "avg_seq_len": 40 + step,
                    "tokens_per_s": 350 + 5 * step,
                    "time_train_s": 3.9,
                    "time_publish_s": 0.17,
                    "time_wait_s": 0.03,
                },
            )
        )
        store.add_weight_version(
            WeightVersionRecord(
                step,
                str(checkpoint),
                metadata={
                    "step": step,
                    "swap": {
                        "http://127.0.0.1:30000": {
                            "pause_s": 0.04,
                            "update_s": 0.12,
                            "continue_s": 0.004,
                            "total_s": 0.164,
                        }
                    },
                    "swap_s": 0.17,
                    "publish_to_live_s": 0.21,
                    "live_at": time.time(),
                },
            )
        )
    deadline = time.monotonic() + 30
    while gw.state.live_version != steps:
        assert time.monotonic() < deadline, "the gateway never swapped to the seeded version"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def recorded(console_gateway, tiny_model_dir):
    """Two scored episodes and a training history in the module's gateway."""
    first = record_episode(console_gateway, "calc-add", 1.0)
    record_episode(console_gateway, "calc-add", 0.25)
    seed_training(console_gateway, tiny_model_dir)
    return first


def test_sign_in_create_and_revoke_a_key(page, console_gateway, recorded, screenshot):
    base = console_gateway.url
    page.goto(f"{base}/console/login")
    page.fill("#admin_key", "sk-areal-not-the-admin-key")
    page.click("button[type=submit]")
    assert page.locator("p.error").is_visible()
    assert "not the admin key" in page.inner_text("p.error")
    screenshot("login-refused")

    sign_in(page, base)
    page.wait_for_selector("#live-version")
    assert page.url.rstrip("/").endswith("/console")
    assert page.inner_text("h1") == "Overview"
    body = page.inner_text("main")
    assert "Live weight version" in body and "Open sessions" in body
    assert console_gateway.state.backends.status()[0].url in body
    screenshot("overview", "console-overview.png")
    # htmx (vendored, under the page's CSP) polls the live figures every 5 s.
    with page.expect_response("**/console/partials/overview", timeout=8000) as polled:
        pass
    assert polled.value.status == 200
    assert page.locator("#live-version").inner_text() == "v12"

    page.click("nav >> text=Keys")
    page.fill("input[name=name]", "browser-runner")
    page.click("text=Create key")
    plaintext = page.inner_text("#new-key").strip()
    assert plaintext.startswith("sk-areal-")
    assert (
        httpx.get(
            f"{console_gateway.v1}/models", headers={"authorization": f"Bearer {plaintext}"}
        ).status_code
        == 200
    )
    screenshot("key-created")

    page.goto(f"{base}/console/keys")
    assert plaintext not in page.content()  # shown once
    row = page.locator("tr", has_text="browser-runner")
    page.once("dialog", lambda dialog: dialog.accept())
    row.locator("button", has_text="Revoke").click()
    page.wait_for_selector("p.notice")
    assert row.locator(".badge").inner_text() == "revoked"
    assert (
        httpx.get(
            f"{console_gateway.v1}/models", headers={"authorization": f"Bearer {plaintext}"}
        ).status_code
        == 401
    )

    page.click("nav >> text=Sign out")
    page.wait_for_url("**/console/login")
    page.goto(f"{base}/console/keys")
    assert "/console/login" in page.url


def test_session_page_shows_messages_tokens_and_reward(page, console_gateway, recorded, screenshot):
    session_id, completion_id = recorded
    stored = console_gateway.state.store.get_completion(completion_id)
    sign_in(page, console_gateway.url)
    page.wait_for_selector("#live-version")
    page.click("nav >> text=Sessions")
    assert "calc-add" in page.inner_text("table.sessions")
    screenshot("sessions")
    page.click(f"text={session_id}")
    page.wait_for_selector(".turn")

    assert page.inner_text("#session-return").startswith("1")
    assert page.locator(".reward-value").first.inner_text() == "1"
    messages = page.inner_text(".messages")
    assert "What is 2 + 3?" in messages and "add" in messages and '"a": 2' in messages
    tool = page.locator(".msg.role-tool")
    assert "result of call_1" in tool.inner_text() and "5" in tool.inner_text()

    tokens = page.locator(".tokens.output .tok")
    assert tokens.count() == len(stored.output_ids) > 0
    title = tokens.first.get_attribute("title")
    assert title.startswith(f"id {stored.output_ids[0]} · logprob ")
    assert title.endswith(f"· version {stored.output_versions[0]}")
    tokens.first.hover()
    trained = page.locator(".tokens.sequence .tok:not(.ctx)")
    assert trained.count() == len(stored.output_ids)
    assert page.locator(".tokens.sequence .tok.ctx").count() == len(stored.prompt_ids)
    screenshot("session", "console-session.png")


def test_training_page_draws_the_curves(page, console_gateway, recorded, screenshot):
    sign_in(page, console_gateway.url)
    page.wait_for_selector("#live-version")
    page.click("nav >> text=Training")
    page.wait_for_selector("#charts .chart canvas")
    titles = page.locator("#charts .u-title").all_inner_texts()
    assert {
        "Task reward",
        "Loss",
        "Approx. KL",
        "Entropy",
        "Staleness",
        "Tokens / s",
        "Step time (s)",
    } <= set(titles)
    # The reward chart has pixels drawn (uPlot paints lines on a canvas).
    painted = page.evaluate("""() => {
        const box = [...document.querySelectorAll('#charts .chart')]
            .find(b => b.dataset.title === 'Task reward');
        const c = box.querySelector('canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
        return n; }""")
    assert painted > 500
    assert "12 steps" in page.inner_text("h1")
    assert page.inner_text("#chart-status").endswith(" UTC.")  # as every console time
    # Each legend shows the last step's values before any hover (uPlot's default: "--").
    values = page.locator("#charts .u-legend .u-series:not(:first-child) .u-value")
    assert values.count() > 0 and "--" not in values.all_inner_texts()
    screenshot("training", "console-training.png")

    page.click("nav >> text=Weights")
    table = page.inner_text("table.weights")
    assert "v12 live" in table and "164 ms" in table and "http://127.0.0.1:30000" in table
    # v12's row carries the swap the gateway really performed (its own backend's timings).
    swap = console_gateway.state.store.get_weight_version(12).metadata["swap"]
    (backend,) = swap
    assert backend == console_gateway.state.backends.status()[0].url and backend in table
    screenshot("weights")
    assert page.locator("#policy-note").count() == 0  # no named policies here
