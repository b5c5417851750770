"""Reward ids belong to the key that posted them: another key posting the same id
neither reads the first reward (its metadata) nor squats the id; and a reward beyond
`gateway.limits.reward_max_abs` is refused at the source (400), so no return can overflow to a
non-finite number that the export or the trainer would see."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from alembic import command
from sqlalchemy import create_engine, text

from areal_service.store import alembic_config, upgrade_database

ADMIN = {"Authorization": "Bearer sk-test-admin"}


@pytest.fixture(scope="module")
def gw(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, engine_url: str
) -> Iterator[Any]:
    from support.harness import run_gateway

    with run_gateway(tmp_path_factory.mktemp("rewards"), tiny_model_dir, [engine_url]) as gateway:
        yield gateway


def _session(gw: Any, **body: Any) -> dict[str, Any]:
    started = httpx.post(gw.url + "/rl/sessions", json=body, headers=ADMIN)
    assert started.status_code == 201, started.text
    return started.json()


def _reward(gw: Any, key: str, **body: Any) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/rewards", json=body, timeout=30, headers={"Authorization": f"Bearer {key}"}
    )


def test_reward_ids_are_scoped_to_the_posting_key(gw: Any) -> None:
    a, b = _session(gw), _session(gw)
    first = _reward(
        gw,
        b["api_key"],
        id="r-1",
        session_id=b["session_id"],
        value=0.5,
        metadata={"secret": "b's judge notes"},
    )
    assert first.status_code == 201, first.text
    # A replaying B's exact body is refused by B's session (403), not answered with
    # B's record.
    leak = _reward(gw, a["api_key"], id="r-1", session_id=b["session_id"], value=0.5)
    assert leak.status_code == 403 and "secret" not in leak.text
    # A posts B's id on its own session: a reward of its own, nothing of B's shown.
    own = _reward(gw, a["api_key"], id="r-1", session_id=a["session_id"], value=1.0)
    assert own.status_code == 201, own.text
    assert own.json()["session_id"] == a["session_id"] and "secret" not in own.text
    # Both retries stay idempotent within their own scope.
    again = _reward(gw, b["api_key"], id="r-1", session_id=b["session_id"], value=0.5)
    assert again.status_code == 201 and again.json()["metadata"] == {"secret": "b's judge notes"}
    store = gw.state.store
    owners = {
        r.owner
        for sid in (a["session_id"], b["session_id"])
        for r in store.list_rewards(session_id=sid)
    }
    assert len(owners) == 2 and "" not in owners  # one "r-1" per key
    assert store.get_reward("r-1") is None  # nor is it the admin's
    detail = httpx.get(f"{gw.url}/rl/sessions/{b['session_id']}", headers=ADMIN).json()
    assert [(r["id"], r["value"]) for r in detail["rewards"]] == [("r-1", 0.5)]


def test_squatting_an_id_does_not_block_another_key(gw: Any) -> None:
    a, b = _session(gw), _session(gw)
    squat = _reward(gw, a["api_key"], id="shared", session_id=a["session_id"], value=0.0)
    assert squat.status_code == 201
    mine = _reward(gw, b["api_key"], id="shared", session_id=b["session_id"], value=1.0)
    assert mine.status_code == 201, mine.text
    assert mine.json()["value"] == 1.0


@pytest.mark.parametrize("target", ["session", "group"])
def test_a_reward_beyond_the_cap_is_400(gw: Any, target: str) -> None:
    """Every reward is bounded by `gateway.limits.reward_max_abs` (1e6 by default), so no sum of
    them can overflow: two rewards of 1e308 (a return of inf) are never both stored."""
    started = _session(gw, group_size=2)
    session = started["sessions"][0]
    where = (
        {"session_id": session["session_id"]}
        if target == "session"
        else {"group_id": started["group_id"]}
    )
    key = session["api_key"] if target == "session" else "sk-test-admin"
    cap = gw.state.config.gateway.limits.reward_max_abs
    assert cap == 1e6
    for value in (1e308, -1e308, cap * 1.000001, -cap - 1):
        refused = _reward(gw, key, value=value, **where)
        assert refused.status_code == 400, (value, refused.text)
        error = refused.json()["error"]
        assert error["param"] == "value" and error["type"] == "invalid_request_error"
        assert "reward_max_abs" in error["message"]
    assert _reward(gw, key, value=cap, **where).status_code == 201  # the cap itself is fine
    assert _reward(gw, key, value=-cap, additive=True, **where).status_code == 201
    stored = gw.state.store.list_rewards(**where)
    assert sorted(r.value for r in stored) == [-cap, cap]


def test_migration_keeps_existing_rewards_as_the_admins(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    command.upgrade(alembic_config(url), "0003_requested_model")
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO rewards (id, value, name, metadata, created_at, group_id) "
                "VALUES ('old-1', 0.25, 'reward', '{}', 1.0, 'g')"
            )
        )
    upgrade_database(url)
    with engine.connect() as connection:
        rows = connection.execute(text("SELECT id, owner, value FROM rewards")).all()
    engine.dispose()
    assert rows == [("old-1", "", 0.25)]
