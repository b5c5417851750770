"""The learning audit's readiness gap: one policy's claimer finds its ready group while
another policy has older ready groups (the first readiness query filters by policy; if
it did not, the oldest groups of every policy would fill the claimer's batch and then be
dropped as not its own: a policy starved, with the unit suite still green)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx

from areal_service.store.claims import EpisodeClaimer

ADMIN = {"authorization": "Bearer sk-test-admin"}
POLICIES = (
    "trainer.lora.rank=4",
    "trainer.lora.alpha=8",
    "policies=[{name: tenanta, model_names: [a-model]}, {name: tenantb, model_names: [b-model]}]",
    "gateway.sessions.staleness_gate=false",
)


def _rewarded_group(http: httpx.Client, policy: str) -> str:
    """A group of 2 episodes of `policy`, each one turn, rewarded and ended."""
    started = http.post("/rl/sessions", headers=ADMIN, json={"group_size": 2, "policy": policy})
    assert started.status_code == 201, started.text
    for s in started.json()["sessions"]:
        key = {"authorization": f"Bearer {s['api_key']}"}
        turn = http.post(
            "/v1/chat/completions",
            headers=key,
            json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "q"}]},
        )
        assert turn.status_code == 200, turn.text
        reward = {"session_id": s["session_id"], "value": 1.0, "end_session": True}
        assert http.post("/v1/rewards", headers=key, json=reward).status_code == 201
    return str(started.json()["group_id"])


def test_a_policy_claims_its_group_behind_another_policys_older_ones(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve(*POLICIES) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
        older_b = [_rewarded_group(http, "tenantb") for _ in range(3)]
        newer_a = _rewarded_group(http, "tenanta")
        claims = {
            policy: EpisodeClaimer(gw.state.store, reward_wait_s=0.0, policy=policy).claim_groups(
                group_size=2, max_groups=1, current_version=0, max_staleness=None, claimer=policy
            )
            for policy in ("tenanta", "tenantb")
        }
        assert [g.group_id for g in claims["tenanta"].groups] == [newer_a]
        assert [g.group_id for g in claims["tenantb"].groups] == [older_b[0]]
        assert claims["tenanta"].dropped == () and claims["tenantb"].dropped == ()
