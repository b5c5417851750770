"""Issue 37's "done when": a two-tenant run with roles trains each policy only on its own
sessions. Tenant A is `solver`, whose episodes open the role `reviewer` (both created at
runtime through the admin API, the solver's role declared there); tenant B is `tenantb`
(the config's). Keys are bound to each; every episode also names the other tenant's
alias (the audit's N1 and N2), which must stay in its own policy. Each policy's trainer
runs for real (the tiny model, the local engine), tenant B ahead of A by a version, so a
token of B's recorded in A's session would train at negative staleness.

Then, from the store: no completion's policy differs from its session's, each
version of each policy was trained on that policy's sessions only, and no trainer step
(store or log line) saw a negative staleness. About 45 s (three trainers, two rounds),
so it is in the default run."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select
from support.harness import ADMIN_KEY, run_gateway
from support.trainer_run import train_in_thread

from areal_service.config import ServiceConfig
from areal_service.policy_registry import with_runtime_policies
from areal_service.store import TrajectoryStore
from areal_service.store.schema import CompletionRow, SessionRow
from areal_service.types import role_session_id
from engine.testing import start_engine_in_thread

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
CONFIG = (
    "default_policy.lora.rank=8",
    "default_policy.lora.alpha=16",
    "policies=[{name: tenantb, model_names: [tenantb-model]}]",
    "trainer.group_size=2",
    "trainer.batch_groups=1",
    "trainer.lr=1e-2",
    "trainer.reward_wait_s=0",
    "gateway.sessions.staleness_gate=false",
)
ALIASES = ("solver-model", "reviewer-model", "tenantb-model")


def _admin(gw: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(gw.url + path, headers=ADMIN, json=body, timeout=60)
    assert reply.status_code in (200, 201), reply.text
    return dict(reply.json())


def _ask(gw: Any, key: str, model: str) -> None:
    client = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)
    client.chat.completions.create(
        model=model, max_tokens=6, messages=[{"role": "user", "content": f"{model}: 2+3="}]
    )


def _reward(gw: Any, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/rewards", headers={"authorization": f"Bearer {key}"}, json=body, timeout=60
    )


def _group(gw: Any, policy: str, value: float) -> list[str]:
    """A group of 2 episodes of `policy` played and rewarded; their session ids. Each
    episode names every alias and tries a role reward for a policy its own does not
    declare (400); the solver's then rewards its reviewer role."""
    sessions = _admin(gw, "/rl/sessions", {"group_size": 2, "policy": policy})["sessions"]
    for j, s in enumerate(sessions):
        for model in ALIASES:
            _ask(gw, s["api_key"], model)
        body: dict[str, Any] = {"session_id": s["session_id"], "value": value + j}
        # The audit's N1: a role reward into a policy the episode's does not declare.
        other = "reviewer" if policy == "tenantb" else "tenantb"
        refused = _reward(gw, s["api_key"], {**body, "role_rewards": {other: 1e6}})
        assert refused.status_code == 400, refused.text
        if policy == "solver":
            body["role_rewards"] = {"reviewer": 0.5 - j}
        posted = _reward(gw, s["api_key"], {**body, "end_session": True})
        assert posted.status_code == 201, posted.text
    return [s["session_id"] for s in sessions]


def _trainer_config(gw: Any, policy: str, steps: int) -> ServiceConfig:
    runtime = gw.state.store.policies.list_policies()
    config = with_runtime_policies(gw.config, runtime, policy)
    return config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"total_steps": steps})}
    )


def _round(
    gw: Any, keys: dict[str, str], episodes: dict[str, list[str]], groups: dict[str, int]
) -> None:
    """`groups[p]` groups of each tenant's episodes, a turn of each bound key naming every
    alias, then one trainer step per group for each policy (the reviewer's roles come
    with the solver's groups), each trainer resuming where it stopped."""
    for policy, count in groups.items():
        for _ in range(count):
            episodes[policy] += _group(gw, policy, float(len(episodes[policy])))
    for key in keys.values():
        for model in ALIASES:
            _ask(gw, key, model)
    steps = {"tenantb": len(episodes["tenantb"]) // 2, "solver": len(episodes["solver"]) // 2}
    steps["reviewer"] = steps["solver"]
    for policy, total in steps.items():
        train_in_thread(_trainer_config(gw, policy, total), timeout_s=300)


def _wait_live(gw: Any, versions: dict[str, int]) -> None:
    deadline = time.monotonic() + 120
    while any(gw.state.policy_versions.get(p, 0) < v for p, v in versions.items()):
        assert time.monotonic() < deadline, (gw.state.policy_versions, versions)
        time.sleep(0.1)


def _completions(store: TrajectoryStore) -> list[tuple[str, str, str, list[int]]]:
    """Every completion's (policy served, session, session's policy, token versions)."""
    with store.engine.connect() as connection:
        rows = connection.execute(
            select(CompletionRow.id, SessionRow.id, SessionRow.policy).join(
                SessionRow, SessionRow.id == CompletionRow.session_id
            )
        ).all()
    out = []
    for completion_id, session_id, policy in rows:
        c = store.get_completion(completion_id)
        out.append((c.model, session_id, policy, list(c.output_versions)))
    return out


def test_two_tenants_with_roles_train_only_their_own_sessions(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="trainer.metrics")
    with (
        start_engine_in_thread(tiny_model_dir) as engine,  # its own: adapters stay loaded
        run_gateway(tmp_path, tiny_model_dir, [engine], *CONFIG) as gw,
    ):
        store = gw.state.store
        _admin(gw, "/admin/policies", {"name": "reviewer", "model_names": ["reviewer-model"]})
        _admin(gw, "/admin/policies", {"name": "solver", "model_names": ["solver-model"]})
        patched = httpx.patch(
            gw.url + "/admin/policies/solver", headers=ADMIN, json={"roles": ["reviewer"]}
        )
        assert patched.status_code == 200 and patched.json()["roles"] == ["reviewer"]
        # Keys bound to each tenant's policies, each naming the others' aliases.
        keys = {
            p: _admin(gw, "/admin/keys", {"name": p, "policy": p})["api_key"]
            for p in ("solver", "reviewer", "tenantb")
        }

        # Round 1: B trains 2 versions, A (solver and its reviewer role) 1.
        episodes: dict[str, list[str]] = {"solver": [], "tenantb": []}
        _round(gw, keys, episodes, {"solver": 1, "tenantb": 2})
        _wait_live(gw, {"tenantb": 2, "solver": 1, "reviewer": 1})
        # Round 2: served by those versions (B at v2, A at v1), one more step each.
        _round(gw, keys, episodes, {"solver": 1, "tenantb": 1})

        # No completion recorded in another policy's session; the versions its tokens
        # carry are its own policy's (A never sampled past v1, B reached v2).
        served = _completions(store)
        assert served and all(model == policy for model, _, policy, _ in served), [
            s for s in served if s[0] != s[2]
        ]
        newest = {"solver": 1, "reviewer": 1, "tenantb": 2}
        for _, _, policy, versions in served:
            assert max(versions, default=0) <= newest[policy], (policy, versions)
        assert any(p == "tenantb" and 2 in v for _, _, p, v in served)
        # The reviewer's completions are its roles of the solver's episodes only.
        for sid in episodes["solver"]:
            assert store.get_session(role_session_id(sid, "reviewer")).policy == "reviewer"
        for sid in episodes["tenantb"]:
            assert store.get_session(role_session_id(sid, "reviewer")) is None

        # Each version of each policy trained on that policy's sessions only.
        trained: dict[str, set[str]] = {}
        for policy, steps in (("solver", 2), ("reviewer", 2), ("tenantb", 3)):
            for version in range(1, steps + 1):
                record = store.get_weight_version(version, policy)
                assert record is not None, (policy, version)
                for session_ids in record.metadata["episodes"].values():
                    for sid in session_ids:
                        assert store.get_session(sid).policy == policy, (policy, sid)
                        trained.setdefault(policy, set()).add(sid)
            assert len(store.list_train_steps(policy=policy)) == steps
        # (Every episode trained; a bound key's own session may have too, once idle.)
        assert set(episodes["solver"]) <= trained["solver"]
        assert set(episodes["tenantb"]) <= trained["tenantb"]
        roles = {role_session_id(sid, "reviewer") for sid in episodes["solver"]}
        assert roles <= trained["reviewer"]
        assert store.list_train_steps() == []  # the default policy trained nothing

        # No negative staleness: in the stored steps and in every trainer log line.
        for policy in ("solver", "reviewer", "tenantb"):
            for step in store.list_train_steps(policy=policy):
                assert step.metrics["staleness_min"] >= 0, (policy, step)
        lines = [r.getMessage() for r in caplog.records if " stale " in r.getMessage()]
        assert len(lines) == 7, lines
        for line in lines:
            found = re.search(r"stale (-?[\d.]+)/(-?\d+) min (-?\d+)", line)
            assert found is not None, line
            assert min(float(g) for g in found.groups()) >= 0, line
