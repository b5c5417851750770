"""Reward settling through the real gateway and engine: a judge that scores one second
after the episode ended is trained with its value, the console shows what awaits a
reward, and a session can declare at its end that no reward will come."""

from __future__ import annotations

import re
import time

import httpx
import openai
from support.harness import ADMIN_KEY

from areal_service.config import TrainerConfig
from areal_service.store.claims import EpisodeClaimer
from trainer.advantage import group_advantages

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def _one_turn(gw, key: str) -> str:
    client = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)
    return client.chat.completions.create(
        model="areal-policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    ).id


def _console(gw) -> httpx.Client:
    http = httpx.Client(base_url=gw.url, timeout=60)
    page = http.get("/console/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    http.post("/console/login", data={"csrf_token": token, "admin_key": ADMIN_KEY})
    return http


def _claim(claimer: EpisodeClaimer, group_size: int | None):
    return claimer.claim_groups(
        group_size=group_size, max_groups=4, current_version=0, max_staleness=None, claimer="test"
    )


def test_late_reward_is_trained_with_its_value_and_no_reward_settles(gateway):
    http = httpx.Client(base_url=gateway.url, timeout=60)
    started = http.post("/rl/sessions", json={"group_size": 2}, headers=ADMIN).json()
    s1, s2 = started["sessions"]
    for s in (s1, s2):
        _one_turn(gateway, s["api_key"])
        ended = http.post(
            f"/rl/sessions/{s['session_id']}/end",
            headers={"authorization": f"Bearer {s['api_key']}"},
        )
        assert ended.status_code == 200 and ended.json()["end_reason"] == "client"
    ended_at = time.time()
    assert (
        http.post(
            "/v1/rewards", json={"session_id": s1["session_id"], "value": 1.0}, headers=ADMIN
        ).status_code
        == 201
    )
    # The trainer's claimer, as `areal-service trainer` builds it (default window: 60 s).
    claimer = EpisodeClaimer.from_config(gateway.state.store, TrainerConfig(group_size=2))
    assert _claim(claimer, 2).groups == ()  # s2's judge has not scored yet
    console = _console(gateway)
    overview = console.get("/console/partials/overview").text
    assert re.search(r'id="awaiting-reward">1 awaiting reward<', overview), overview

    time.sleep(max(0.0, ended_at + 1.0 - time.time()))  # the judge scores 1 s after the end
    assert (
        http.post(
            "/v1/rewards", json={"session_id": s2["session_id"], "value": 1.0}, headers=ADMIN
        ).status_code
        == 201
    )
    (group,) = _claim(claimer, 2).groups
    assert group.session_ids == (s1["session_id"], s2["session_id"])
    assert group.session_returns == (1.0, 1.0)  # not (1.0, 0.0): advantages (+1, -1)
    assert group_advantages([group.session_returns], "grpo", 1e-6) == [[0.0, 0.0]]

    # No reward will come for this one: it settles at its end, under the default policy
    # (drop_group) it is dropped at once instead of waiting out the window.
    solo = http.post("/rl/sessions", json={}, headers=ADMIN).json()
    _one_turn(gateway, solo["api_key"])
    ended = http.post(
        f"/rl/sessions/{solo['session_id']}/end",
        json={"no_reward": True},
        headers={"authorization": f"Bearer {solo['api_key']}"},
    )
    assert ended.status_code == 200 and ended.json()["end_reason"] == "no_reward"
    result = _claim(claimer, None)
    assert result.groups == ()
    assert [d.session_ids for d in result.dropped] == [(solo["session_id"],)]
    assert result.dropped[0].reason == "unrewarded: 1 of 1 sessions (1 declared no reward)"
    overview = console.get("/console/partials/overview").text
    assert 'id="awaiting-reward">0 awaiting reward<' in overview
    assert re.search(r'id="dropped-unrewarded">1 dropped: unrewarded', overview), overview
    listing = console.get("/console/sessions", params={"status": "dropped"}).text
    assert "dropped: unrewarded: 1 of 1 sessions" in listing
    # The admin status counts what the staleness gate counts: the dropped one gave its
    # place back (3 started, 2 admitted).
    status = http.get("/admin/status", headers=ADMIN).json()
    assert (status["started_sessions"], status["admitted_sessions"]) == (3, 2)
