"""The console's Policies pages in real headless Chromium after a real run with two
policies on the local engine: the solver's trainer trains two steps, the verifier's one,
each publishes its adapter and the gateway swaps it. The list shows both policies'
versions, sessions and windows; the solver's page draws its reward and loss curves and
lists its versions with the swap timings the gateway really recorded. Screenshots land
in the test's tmp dir (and docs/ with AREAL_SAVE_SCREENSHOTS=1)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.harness import Gateway, run_gateway
from support.policy_run import POLICY_OVERRIDES, policy_episodes, train_policy, wait_swapped
from test_console_browser import sign_in

from engine.testing import start_engine_in_thread

PAINTED = """(title) => {
    const box = [...document.querySelectorAll('#charts .chart')]
        .find(b => b.dataset.title === title);
    const c = box.querySelector('canvas');
    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
    let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
    return n; }"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Gateway]:
    """A gateway with two policies whose trainers really trained: solver 2 steps (v2),
    verifier 1 step (v1)."""
    with (
        start_engine_in_thread(tiny_model_dir) as engine_url,
        run_gateway(
            tmp_path_factory.mktemp("policies"), tiny_model_dir, [engine_url], *POLICY_OVERRIDES
        ) as gw,
    ):
        policy_episodes(gw, "solver", 4)
        policy_episodes(gw, "verifier", 2)
        train_policy(gw, "solver", total_steps=2)
        train_policy(gw, "verifier", total_steps=1)
        wait_swapped(gw, "solver", 2)
        wait_swapped(gw, "verifier", 1)
        yield gw


def test_policies_pages_show_both_policies(page, trained, screenshot) -> None:
    store = trained.state.store
    sign_in(page, trained.url)
    page.wait_for_selector("#live-version")
    page.click("nav >> text=Policies")
    page.wait_for_selector("table.policies")
    assert page.inner_text("h1").startswith("Policies")
    assert page.get_attribute("#new-policy", "href") == "/console/policies/new"
    for name, version in (("solver", 2), ("verifier", 1), ("default", 0)):
        row = page.locator(f"#policy-{name}")
        assert row.locator(".live-version").inner_text() == f"v{version}"
        published = store.latest_weight_version(name)
        assert row.locator(".published-version").inner_text() == (
            f"v{published.version}" if published else "none"
        )
        trained_n = sum(
            1 for s in store.list_sessions(limit=1000) if s.policy == name and s.status == "trained"
        )
        assert row.locator(".sessions-trained").inner_text() == str(trained_n)
    assert page.locator("#policy-solver").inner_text().count("solver-model") == 1
    screenshot("policies", "console-policies.png")

    page.click("#policy-solver a")
    page.wait_for_selector("#charts .chart canvas")
    assert page.inner_text("h1").startswith("Policy solver")
    assert "2 steps" in page.inner_text("h1")
    assert page.inner_text("#policy-live-version") == "v2"
    titles = set(page.locator("#charts .u-title").all_inner_texts())
    assert {"Task reward", "Loss", "Staleness"} <= titles
    assert page.evaluate(PAINTED, "Task reward") > 200
    assert page.evaluate(PAINTED, "Loss") > 200
    # The versions with the swap the gateway performed, per backend.
    table = page.inner_text("table.policy-versions")
    assert "v2 live" in table and "v1" in table
    (backend,) = store.get_weight_version(2, "solver").metadata["swap"]
    assert backend == trained.state.backends.status()[0].url and backend in table
    steps = store.list_train_steps(policy="solver")
    assert [s.step for s in steps] == [1, 2]
    assert page.locator("table.steps tbody tr").count() == 2
    screenshot("policy", "console-policy.png")

    page.goto(f"{trained.url}/console/policies/verifier")
    page.wait_for_selector("#charts .chart canvas")
    assert page.inner_text("#policy-live-version") == "v1"
    assert "1 step" in page.inner_text("h1") and "steps" not in page.inner_text("h1")
    for other in ("training", "weights"):  # the default policy's pages point to these
        page.goto(f"{trained.url}/console/{other}")
        assert page.get_attribute("#policy-note a", "href") == "/console/policies"
    page.goto(f"{trained.url}/console/policies/default")
    assert "No training steps yet" in page.inner_text("main")
    assert "No version published yet" in page.inner_text("main")
