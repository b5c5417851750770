"""A run with two named policies on one gateway (the set-up of
`tests/integration/test_policies_lora.py`): rewarded episodes opened for a policy, that
policy's trainer run on a thread, and the wait for the gateway to swap its adapter."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai

from support.harness import ADMIN_KEY
from support.trainer_run import train_in_thread

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
POLICY_OVERRIDES = (
    "trainer.group_size=2",
    "trainer.batch_groups=2",
    "trainer.lr=1e-2",
    "trainer.total_steps=1",
    "gateway.sessions.staleness_gate=false",
    "trainer.lora.rank=8",
    "trainer.lora.alpha=16",
    "policies=[{name: solver, model_names: [solver-model]}, {name: verifier}]",
)


def policy_episodes(
    gw: Any, policy: str, n_groups: int, *, start: int = 0, timeout_s: float = 60
) -> None:
    """`n_groups` rewarded, ended groups of 2 sessions opened by the admin for `policy`
    (rewards j + 0.25·g, posted by each session's own key)."""
    http = httpx.Client(base_url=gw.url, timeout=timeout_s)
    for g in range(start, start + n_groups):
        started = http.post("/rl/sessions", json={"group_size": 2, "policy": policy}, headers=ADMIN)
        assert started.status_code == 201, started.text
        for j, s in enumerate(started.json()["sessions"]):
            client = openai.OpenAI(base_url=gw.v1, api_key=s["api_key"], max_retries=0)
            client.chat.completions.create(
                model="my-agent",
                max_tokens=8,
                messages=[{"role": "user", "content": f"{policy} count to {g}"}],
            )
            reward = http.post(
                "/v1/rewards",
                json={
                    "session_id": s["session_id"],
                    "value": float(j) + 0.25 * g,
                    "end_session": True,
                },
                headers={"authorization": f"Bearer {s['api_key']}"},
            )
            assert reward.status_code == 201, reward.text


def train_policy(gw: Any, policy: str, total_steps: int = 1) -> None:
    """`policy`'s trainer (`trainer --policy`) run on a thread until `total_steps`."""
    trainer = gw.config.trainer.model_copy(update={"policy": policy, "total_steps": total_steps})
    train_in_thread(gw.config.model_copy(update={"trainer": trainer}), timeout_s=240)


def wait_swapped(gw: Any, policy: str, version: int, timeout_s: float = 60) -> None:
    """Until the gateway serves `policy`'s `version`."""
    deadline = time.monotonic() + timeout_s
    while gw.state.policy_versions.get(policy, 0) < version:
        assert time.monotonic() < deadline, f"{policy} v{version} never went live"
        time.sleep(0.05)
