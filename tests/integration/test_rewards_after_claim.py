"""Rewards against the claim, through the real gateway on SQLite and PostgreSQL: a group
reward after its group was claimed is a 409 and the export shows what was trained; a
second reward of the same name is a 409 unless additive, and the reply shows the target's
total; a reward posted while a claim is being committed on another connection waits for
it and is refused (it used to be checked before and inserted after: 201, never trained).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from areal_service.export import iter_export_rows
from areal_service.store.claims import EpisodeClaimer

ADMIN = {"Authorization": "Bearer sk-test-admin"}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def gw(
    request: pytest.FixtureRequest, tmp_path: Path, tiny_model_dir: Path, engine_url: str
) -> Iterator[Any]:
    from support.harness import run_gateway
    from support.postgres_db import fresh_postgres_database

    overrides: list[str] = []
    if request.param == "postgres":
        databases = fresh_postgres_database()
        overrides.append(f"store.url={next(databases)}")
    with run_gateway(tmp_path, tiny_model_dir, [engine_url], *overrides) as gateway:
        yield gateway
    if request.param == "postgres":
        next(databases, None)  # drops the database


def _post(gw: Any, path: str, key: str | None = None, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else ADMIN
    return httpx.post(gw.url + path, json=body, headers=headers, timeout=60)


def _group(gw: Any, size: int) -> dict[str, Any]:
    """A group of `size` sessions, each with one short completion, ended."""
    started = _post(gw, "/rl/sessions", group_size=size, task_id="t")
    assert started.status_code == 201, started.text
    for session in started.json()["sessions"]:
        chat = _post(
            gw,
            "/v1/chat/completions",
            session["api_key"],
            model="m",
            max_tokens=2,
            messages=[{"role": "user", "content": "hi"}],
        )
        assert chat.status_code == 200, chat.text
        assert (
            _post(gw, f"/rl/sessions/{session['session_id']}/end", session["api_key"]).status_code
            == 200
        )
    return started.json()


def test_a_group_reward_after_the_claim_is_refused_and_export_shows_the_trained(gw: Any):
    group = _group(gw, 2)
    gid = group["group_id"]
    first, second = (s["session_id"] for s in group["sessions"])
    assert _post(gw, "/v1/rewards", session_id=first, value=1.0).status_code == 201
    assert _post(gw, "/v1/rewards", session_id=second, value=0.0).status_code == 201
    store = gw.state.store
    claimed = EpisodeClaimer(store).claim_groups(
        group_size=2, max_groups=1, current_version=0, max_staleness=None, claimer="t"
    )
    assert [g.session_returns for g in claimed.groups] == [(1.0, 0.0)]
    late = _post(gw, "/v1/rewards", group_id=gid, value=5.0)
    assert late.status_code == 409, late.text
    error = late.json()["error"]
    assert error["code"] == "session_trained" and error["param"] == "group_id"
    assert "claimed" in error["message"] and gid in error["message"]
    EpisodeClaimer(store).mark_trained(claimed.groups[0].claim_id)
    assert _post(gw, "/v1/rewards", group_id=gid, value=5.0).status_code == 409
    assert store.list_rewards(group_id=gid) == []
    exported = {row["session_id"]: row["session_return"] for row in iter_export_rows(store)}
    assert exported == {first: 1.0, second: 0.0}


def test_a_second_reward_of_the_same_name_is_refused_unless_additive(gw: Any):
    (session,) = _group(gw, 1)["sessions"]
    sid, key = session["session_id"], session["api_key"]
    first = _post(gw, "/v1/rewards", key, session_id=sid, value=1.0)
    assert first.status_code == 201 and first.json()["target_total"] == 1.0
    again = _post(gw, "/v1/rewards", key, session_id=sid, value=0.5)
    assert again.status_code == 409, again.text
    error = again.json()["error"]
    assert error["code"] == "reward_exists" and error["param"] == "name"
    assert "additive" in error["message"]
    added = _post(gw, "/v1/rewards", key, session_id=sid, value=0.5, additive=True)
    assert added.status_code == 201 and added.json()["target_total"] == 1.5
    bonus = _post(gw, "/v1/rewards", key, session_id=sid, value=0.25, name="format")
    assert bonus.status_code == 201 and bonus.json()["target_total"] == 1.75
    # An idempotent retry of the first is still the first, with the current total.
    retry = _post(gw, "/v1/rewards", key, session_id=sid, value=1.0, id=first.json()["id"])
    assert retry.status_code == 201 and retry.json()["target_total"] == 1.75


def _hold_claim(url: str, sid: str) -> tuple[Any, Any]:
    """A claim of `sid` written but not committed, on a connection of its own (SQLite:
    the database write lock; PostgreSQL: the row lock). Returns (commit, close)."""
    if url.startswith("sqlite"):
        raw = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        raw.execute("BEGIN IMMEDIATE")
        raw.execute(
            "UPDATE sessions SET status = 'claimed', claim_id = 'held' WHERE id = ?", (sid,)
        )
        return (lambda: raw.execute("COMMIT")), raw.close
    engine = create_engine(url)
    connection = engine.connect()
    connection.execute(
        text("UPDATE sessions SET status = 'claimed', claim_id = 'held' WHERE id = :sid"),
        {"sid": sid},
    )
    return connection.commit, lambda: (connection.close(), engine.dispose())


@pytest.mark.parametrize("target", ["session", "group"])
def test_a_reward_racing_a_claim_is_refused_not_lost(gw: Any, target: str):
    group = _group(gw, 2)
    sid = group["sessions"][0]["session_id"]
    body = {"session_id": sid} if target == "session" else {"group_id": group["group_id"]}
    commit, close = _hold_claim(gw.state.config.database_url(), sid)
    replies: list[httpx.Response] = []
    poster = threading.Thread(
        target=lambda: replies.append(_post(gw, "/v1/rewards", value=1.0, **body))
    )
    try:
        poster.start()
        time.sleep(1.0)
        assert not replies, "the reward must wait for the claim's transaction"
        commit()
        poster.join(timeout=60)
    finally:
        close()
    (reply,) = replies
    assert reply.status_code == 409, reply.text
    assert reply.json()["error"]["code"] == "session_trained"
    assert gw.state.store.list_rewards(**body) == []
