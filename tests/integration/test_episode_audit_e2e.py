"""Under the default settings (group_size 4) the curl walkthrough's ungrouped episode and
an `auto_session` key's episode are claimed and trained (they used to wait forever,
holding staleness places), and the audit endpoint and `/metrics` account for them."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from areal_service.store.claims import EpisodeClaimer
from trainer.advantage import sequence_advantages
from trainer.train import claim_group_size

ADMIN = {"Authorization": "Bearer sk-test-admin"}


def _post(gateway: Any, path: str, headers: dict[str, str], **body: Any) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, headers=headers, timeout=60)


def _chat(gateway: Any, key: str) -> None:
    chat = _post(
        gateway,
        "/v1/chat/completions",
        {"Authorization": f"Bearer {key}"},
        model="gpt-4o-mini",
        max_tokens=4,
        messages=[{"role": "user", "content": "What is 2 + 3?"}],
    )
    assert chat.status_code == 200, chat.text


def test_walkthrough_and_auto_session_episodes_are_trained_and_audited(gateway: Any):
    cfg = gateway.state.config.trainer
    assert cfg.group_size == 4 and cfg.advantage == "grpo"  # the defaults
    # The walkthrough: a session without a group, a chat, a reward, the end.
    session = _post(gateway, "/rl/sessions", ADMIN, task_id="curl-demo").json()
    key = session["api_key"]
    _chat(gateway, key)
    assert (
        _post(
            gateway,
            "/v1/rewards",
            {"Authorization": f"Bearer {key}"},
            session_id=session["session_id"],
            value=1.0,
        ).status_code
        == 201
    )
    assert (
        _post(
            gateway, f"/rl/sessions/{session['session_id']}/end", {"Authorization": f"Bearer {key}"}
        ).status_code
        == 200
    )
    # A virtual key with no session: its first call opens one (auto_session).
    user_key = _post(gateway, "/admin/keys", ADMIN, name="agent").json()["api_key"]
    _chat(gateway, user_key)
    store = gateway.state.store
    (auto,) = [s for s in store.list_sessions() if s.metadata.get("opened_by") == "auto_session"]
    assert _post(gateway, "/v1/rewards", ADMIN, session_id=auto.id, value=0.0).status_code == 201
    assert _post(gateway, f"/rl/sessions/{auto.id}/end", ADMIN).status_code == 200

    claimer = EpisodeClaimer.from_config(store, cfg)
    result = claimer.claim_groups(
        group_size=claim_group_size(cfg),
        max_groups=4,
        current_version=0,
        max_staleness=cfg.max_staleness,
        claimer="test",
    )
    assert sorted(g.session_ids[0] for g in result.groups) == sorted(
        [session["session_id"], auto.id]
    )
    assert all(not g.grouped for g in result.groups) and result.dropped == ()
    advantages = sequence_advantages(result.groups, cfg.advantage, cfg.adv_eps)
    assert sorted(a for advs in advantages for a in advs) == pytest.approx([-1.0, 1.0], rel=1e-5)
    claimer.mark_trained([g.claim_id for g in result.groups])

    audit = httpx.get(gateway.url + "/admin/episodes/audit", headers=ADMIN, timeout=30)
    assert audit.status_code == 200, audit.text
    body = audit.json()
    assert body["states"]["trained"] == 2 and body["total"] == 2
    assert body["unaccounted"] == 0 and body["overdue"] == 0
    assert httpx.get(gateway.url + "/admin/episodes/audit", timeout=30).status_code == 401
    metrics = httpx.get(gateway.url + "/metrics", headers=ADMIN, timeout=30).text
    assert 'areal_episodes{state="trained"} 2.0' in metrics
    assert "areal_episodes_unaccounted 0.0" in metrics
    # The console overview shows the same.
    from test_console import _admin_client

    console = _admin_client(gateway)
    tiles = console.get("/console/partials/overview").text
    console.close()
    assert '<div class="value" id="episodes-unaccounted">0 unaccounted</div>' in tiles
    assert "2 trained" in tiles
