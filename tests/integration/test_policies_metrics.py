"""Per-policy metrics and console pages after a real run (issue 29, console and metrics
slice): two keys bound to two policies on the real local engine, episodes and rewards
through the real gateway, one real trainer per policy trains a step and publishes its
adapter, the gateway swaps it. Then every `areal_policy_*` figure of `/metrics` equals
what the store holds (versions, swap timings, rewards, sessions, window, the last
step's loss and reward), and the console's Policies pages show both policies' data."""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.harness import ADMIN_KEY, run_gateway
from support.policy_run import (
    ADMIN,
    POLICY_OVERRIDES,
    policy_episodes,
    train_policy,
    wait_swapped,
)

from areal_service.types import DEFAULT_POLICY
from engine.testing import start_engine_in_thread

POLICIES = ("solver", "verifier")


def _scrape(gw) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """`/metrics` as {(sample name, sorted labels): value}."""
    text = httpx.get(f"{gw.url}/metrics", headers=ADMIN, timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def _login(gw, key: str) -> tuple[httpx.Client, httpx.Response]:
    http = httpx.Client(base_url=gw.url, timeout=60)
    page = http.get("/console/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    done = http.post(
        "/console/login",
        data={"csrf_token": token, "admin_key": key, "next": "/console/policies"},
    )
    return http, done


def test_policy_metrics_match_the_store_after_a_real_run(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trainer.metrics")
    with (
        start_engine_in_thread(tiny_model_dir) as engine,
        run_gateway(tmp_path, tiny_model_dir, [engine], *POLICY_OVERRIDES) as gw,
    ):
        store = gw.state.store
        keys = {
            p: httpx.post(f"{gw.url}/admin/keys", json={"policy": p}, headers=ADMIN, timeout=30)
            for p in POLICIES
        }
        assert all(k.status_code == 201 for k in keys.values())
        policy_episodes(gw, "solver", 2)
        policy_episodes(gw, "verifier", 2)
        # An open group of the solver scored as a whole by the admin: a group reward
        # counts under the policy of the group's sessions.
        http = httpx.Client(base_url=gw.url, timeout=60)
        opened = http.post(
            "/rl/sessions",
            json={"group_size": 2, "policy": "solver", "group_id": "open-solver"},
            headers=ADMIN,
        )
        assert opened.status_code == 201, opened.text
        group = http.post(
            "/v1/rewards", json={"group_id": "open-solver", "value": 0.5}, headers=ADMIN
        )
        assert group.status_code == 201, group.text
        # A replayed reward id is not counted twice.
        sid = opened.json()["sessions"][0]["session_id"]
        for _ in range(2):
            again = http.post(
                "/v1/rewards",
                json={"id": "once", "session_id": sid, "value": 2.0, "name": "bonus"},
                headers=ADMIN,
            )
            assert again.status_code == 201, again.text

        for policy in POLICIES:
            train_policy(gw, policy)
            wait_swapped(gw, policy, 1)

        deadline = time.monotonic() + 30
        while True:  # the syncer exports the live versions at the end of its round
            samples = _scrape(gw)
            if all(_value(samples, "areal_policy_version", policy=p) == 1 for p in POLICIES):
                break
            assert time.monotonic() < deadline, "areal_policy_version never reached v1"
            time.sleep(0.1)

        sessions = store.list_sessions(limit=1000)
        by_policy = Counter((s.policy, s.status) for s in sessions)
        assert by_policy[("solver", "trained")] == 4 and by_policy[("verifier", "trained")] == 4
        policy_of = {s.id: s.policy for s in sessions}
        rewards: dict[str, list[float]] = {p: [] for p in POLICIES}
        for r in store.list_rewards(limit=1000):
            if r.session_id is not None:
                rewards[policy_of[r.session_id]].append(r.value)
            else:
                for p in store.group_policies(r.group_id):
                    rewards[p].append(r.value)
        assert len(rewards["solver"]) == 4 + 1 + 1 and len(rewards["verifier"]) == 4
        trainer = gw.config.trainer
        batch = trainer.batch_groups * trainer.group_size

        print("\npolicy  version  swap_s  reward n/sum  loss  task_reward")
        for p in POLICIES:
            latest = store.latest_weight_version(p)
            assert latest is not None and latest.version == 1
            assert _value(samples, "areal_policy_version", policy=p) == latest.version
            assert _value(samples, "areal_policy_published_version", policy=p) == 1
            # Swap timings: one observation per backend and phase, equal to the row's.
            (timings,) = latest.metadata["swap"].values()
            for phase in ("pause", "update", "continue", "total"):
                labels = {"policy": p, "phase": phase}
                assert _value(samples, "areal_policy_swap_seconds_count", **labels) == 1
                observed = _value(samples, "areal_policy_swap_seconds_sum", **labels)
                assert observed == pytest.approx(timings[f"{phase}_s"], rel=1e-9)
            assert _value(
                samples, "areal_policy_swap_seconds_sum", policy=p, phase="swap"
            ) == pytest.approx(latest.metadata["swap_s"], rel=1e-9)
            # Rewards posted on the policy's sessions (and groups).
            assert _value(samples, "areal_policy_reward_count", policy=p) == len(rewards[p])
            assert _value(samples, "areal_policy_reward_sum", policy=p) == pytest.approx(
                sum(rewards[p])
            )
            # Sessions, admitted and window.
            for status in ("open", "ended", "claimed", "trained", "dropped"):
                assert _value(
                    samples, "areal_policy_sessions", policy=p, state=status
                ) == by_policy.get((p, status), 0), (p, status)
            admitted = sum(n for (q, st), n in by_policy.items() if q == p and st != "dropped")
            assert _value(samples, "areal_policy_admitted_sessions", policy=p) == admitted
            window = (trainer.max_staleness + 1 + 1) * batch  # at live version 1
            assert _value(samples, "areal_policy_staleness_window", policy=p) == window
            # The trainer's last step.
            (step,) = store.list_train_steps(policy=p)
            assert _value(samples, "areal_policy_train_step", policy=p) == step.step == 1
            assert _value(samples, "areal_policy_train_loss", policy=p) == pytest.approx(
                step.metrics["loss"]
            )
            assert _value(samples, "areal_policy_train_reward", policy=p) == pytest.approx(
                step.metrics["task_reward"]
            )
            print(
                f"{p:8s} v{latest.version}  {latest.metadata['swap_s']:.3f}  "
                f"{len(rewards[p])}/{sum(rewards[p]):.2f}  {step.metrics['loss']:.4f}  "
                f"{step.metrics['task_reward']:.3f}"
            )
            # One TensorBoard run per policy, and the log line names its policy.
            assert (tmp_path / "runs").is_dir()
            assert [d for d in (tmp_path / "runs").iterdir() if d.name.endswith(f"-{p}")]
            assert any(f"[{p}] step 1/1 v1" in r.getMessage() for r in caplog.records)

        # The default policy: untouched, no version, no sessions, the window at v0.
        assert _value(samples, "areal_policy_version", policy=DEFAULT_POLICY) == 0
        assert _value(samples, "areal_policy_published_version", policy=DEFAULT_POLICY) == 0
        assert _value(samples, "areal_policy_reward_count", policy=DEFAULT_POLICY) is None
        assert _value(samples, "areal_policy_train_step", policy=DEFAULT_POLICY) is None
        assert (
            _value(samples, "areal_policy_staleness_window", policy=DEFAULT_POLICY)
            == (trainer.max_staleness + 1) * batch
        )
        # Bounded label values: the policies only.
        labelled = {dict(labels).get("policy") for (name, labels) in samples if "policy" in name}
        assert labelled == {DEFAULT_POLICY, *POLICIES}

        # The console: a tenant's key cannot sign in (only the admin's), so no tenant sees
        # any policy there; the admin sees both policies' figures.
        tenant, refused = _login(gw, keys["solver"].json()["api_key"])
        assert refused.status_code == 401
        assert tenant.get("/console/policies", follow_redirects=False).status_code == 303
        admin, done = _login(gw, ADMIN_KEY)
        assert done.status_code == 303 and done.headers["location"] == "/console/policies"
        listing = admin.get("/console/policies").text
        assert 'href="/console/policies/new"' in listing
        for p in POLICIES:
            row = re.search(rf'<tr id="policy-{p}">(.*?)</tr>', listing, re.S).group(1)
            assert re.search(r'class="num live-version">v1<', row), row
            assert re.search(r'class="num published-version">v1<', row), row
            trained = by_policy[(p, "trained")]
            assert re.search(rf'class="num sessions-trained">{trained}<', row), row
        page = admin.get("/console/policies/solver")
        assert (
            page.status_code == 200 and 'data-src="/console/policies/solver/data.json"' in page.text
        )
        data = admin.get("/console/policies/solver/data.json").json()
        assert data["steps"] == [1]
        titles = {c["title"] for c in data["charts"]}
        assert {"Task reward", "Loss"} <= titles
        assert admin.get("/console/policies/nobody").status_code == 404
        assert admin.get("/console/policies/nobody/data.json").status_code == 404
