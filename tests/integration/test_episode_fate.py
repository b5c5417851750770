"""Every episode's fate reaches its sender: an episode the trainer drops (stale,
unrewarded, group incomplete, failed) is a WARNING naming its reason, and over HTTP on
loopback its own key reads `status: dropped` and `drop_reason` at `GET
/rl/sessions/{id}` (another key cannot), `/metrics` counts it per reason and the
console's overview and sessions pages show it; on SQLite and on PostgreSQL."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from areal_service.store.claims import EpisodeClaimer
from trainer.train import claim_group_size

ADMIN = {"Authorization": "Bearer sk-test-admin"}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _post(gw: Any, path: str, headers: dict[str, str], **body: Any) -> httpx.Response:
    reply = httpx.post(gw.url + path, json=body, headers=headers, timeout=60)
    assert reply.status_code in (200, 201), reply.text
    return reply


def _group(gw: Any, size: int, task: str) -> list[dict[str, Any]]:
    """A group of `size` sessions, one chat each (sampled at the engine's version)."""
    sessions: list[dict[str, Any]] = _post(
        gw, "/rl/sessions", ADMIN, group_size=size, task_id=task
    ).json()["sessions"]
    for s in sessions:
        _post(
            gw,
            "/v1/chat/completions",
            _bearer(s["api_key"]),
            model="areal-policy",
            max_tokens=4,
            messages=[{"role": "user", "content": "What is 2 + 3?"}],
        )
    return sessions


def _reward_and_end(gw: Any, session: dict[str, Any], value: float = 1.0) -> None:
    _post(
        gw,
        "/v1/rewards",
        _bearer(session["api_key"]),
        session_id=session["session_id"],
        value=value,
        end_session=True,
    )


def _sampled_version(gw: Any, session_ids: list[str]) -> int:
    """The oldest version stamped on any token of these sessions."""
    completions = gw.state.store.load_completions(session_ids, with_json=False)
    return min(min(c.output_versions) for cs in completions.values() for c in cs)


def _claim(gw: Any, version: int) -> None:
    """What the trainer's claim does (its settings, its staleness bound) at `version`."""
    cfg = gw.state.config.trainer
    EpisodeClaimer.from_config(gw.state.store, cfg).claim_groups(
        group_size=claim_group_size(cfg),
        max_groups=cfg.batch_groups,
        current_version=version,
        max_staleness=cfg.train_staleness_bound(),
        claimer="test",
    )


@pytest.fixture(params=["sqlite", "postgresql"])
def store_overrides(request: pytest.FixtureRequest) -> list[str]:
    if request.param == "sqlite":
        return []
    return [f"store.url={request.getfixturevalue('postgres_url')}"]


def test_dropped_episodes_reach_their_sender(
    tmp_path: Path,
    tiny_model_dir: Path,
    engine_url: str,
    gateway_factory: Callable[..., Any],
    store_overrides: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = ["trainer.group_size=2", "trainer.reward_wait_s=0", *store_overrides]
    with gateway_factory(tmp_path, tiny_model_dir, [engine_url], *settings) as gw:
        unrewarded = _group(gw, 2, "t-unrewarded")  # ended, never rewarded
        for s in unrewarded:
            _post(gw, f"/rl/sessions/{s['session_id']}/end", _bearer(s["api_key"]))
        failed, left = _group(gw, 2, "t-failed")  # one member's agent failed
        _post(gw, f"/rl/sessions/{failed['session_id']}/end", ADMIN, failed=True)
        _reward_and_end(gw, left)
        with caplog.at_level(logging.WARNING, logger="areal_service.store.claims"):
            _claim(gw, version=_sampled_version(gw, [left["session_id"]]))
            stale = _group(gw, 2, "t-stale")  # claimed bound + 1 versions after sampling
            for s in stale:
                _reward_and_end(gw, s)
            bound = gw.state.config.trainer.train_staleness_bound()
            # The session-wide engine may have been swapped by earlier tests: read the
            # version its tokens carry rather than assume v0.
            sampled = _sampled_version(gw, [s["session_id"] for s in stale])
            _claim(gw, version=sampled + bound + 1)

        expected = {
            "unrewarded": [s["session_id"] for s in unrewarded],
            "failed": [failed["session_id"]],
            "group incomplete": [left["session_id"]],
            "stale": [s["session_id"] for s in stale],
        }
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        for reason, ids in expected.items():
            assert any(reason in w and ids[0] in w for w in warned), (reason, warned)
        assert f"stale: {bound + 1} versions > max_train_staleness {bound}" in "".join(warned)

        keys = {s["session_id"]: s["api_key"] for s in [*unrewarded, failed, left, *stale]}
        for reason, ids in expected.items():
            for sid in ids:
                shown = httpx.get(
                    f"{gw.url}/rl/sessions/{sid}", headers=_bearer(keys[sid]), timeout=30
                )
                assert shown.status_code == 200, shown.text
                body = shown.json()
                assert body["status"] == "dropped", body
                assert body["drop_reason"].startswith(reason), body
        other = httpx.get(
            f"{gw.url}/rl/sessions/{stale[0]['session_id']}",
            headers=_bearer(unrewarded[0]["api_key"]),
            timeout=30,
        )
        assert other.status_code == 403 and "drop_reason" not in other.text

        metrics = httpx.get(gw.url + "/metrics", headers=ADMIN, timeout=30).text
        for reason, ids in expected.items():
            assert f'areal_episodes_dropped{{reason="{reason}"}} {len(ids)}.0' in metrics

        from test_console import _admin_client

        console = _admin_client(gw)
        try:
            tiles = console.get("/console/partials/overview").text
            listing = console.get("/console/sessions", params={"status": "dropped"}).text
        finally:
            console.close()
        assert "6 dropped (failed 1) (group incomplete 1) (stale 2) (unrewarded 2)" in tiles
        assert f"dropped: stale: {bound + 1} versions" in listing
