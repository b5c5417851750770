"""N5: two user keys racing to refresh into one new `group_id` never both get in (the
member check and the insert are one transaction, under the group's lock), nor do the
admin's sessions and a user key's land in one group; on SQLite and PostgreSQL."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from support.security_harness import STORES

from areal_service.store.schema import SessionRow

ADMIN = {"authorization": "Bearer sk-test-admin"}
GROUPS = 20


@pytest.fixture(scope="module", params=STORES)
def gw(request: pytest.FixtureRequest, serve_on: Callable[..., Any]) -> Iterator[Any]:
    with serve_on(request.param) as gateway:
        yield gateway


def _race(calls: list[Callable[[], httpx.Response]]) -> list[httpx.Response]:
    """Run `calls` at once (released together by a barrier)."""
    barrier = threading.Barrier(len(calls))
    replies: list[httpx.Response | None] = [None] * len(calls)

    def run(i: int) -> None:
        barrier.wait()
        replies[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in replies if r is not None]


def _keys_by_group(gw: Any) -> dict[str, set[str | None]]:
    with gw.state.store.engine.connect() as connection:
        rows = connection.execute(select(SessionRow.group_id, SessionRow.api_key_id))
        groups: dict[str, set[str | None]] = {}
        for group, key in rows:
            if group is not None:
                groups.setdefault(group, set()).add(key)
        return groups


def test_raced_refreshes_never_mix_two_keys_in_a_group(gw: Any) -> None:
    users = [
        httpx.post(f"{gw.url}/admin/keys", headers=ADMIN, json={"name": f"u{i}"}, timeout=30)
        for i in range(2)
    ]
    clients = [
        httpx.Client(
            base_url=gw.url, headers={"authorization": f"Bearer {u.json()['api_key']}"}, timeout=60
        )
        for u in users
    ]
    admin = httpx.Client(base_url=gw.url, headers=ADMIN, timeout=60)
    for g in range(GROUPS):
        group = f"grp-race-{g}"
        racers = [*clients, admin] if g % 4 == 3 else clients  # the admin races them too
        joins = [
            functools.partial(c.post, "/rl/sessions", json={"group_id": group}) for c in racers
        ]
        replies = _race(joins)
        codes = sorted(r.status_code for r in replies)
        assert codes.count(201) == 1, [r.text for r in replies]
        for r in replies:
            if r.status_code != 201:
                assert r.json()["error"]["code"] in ("group_not_owned", "group_in_use"), r.text
    groups = _keys_by_group(gw)
    assert len(groups) == GROUPS
    mixed = {g: keys for g, keys in groups.items() if len(keys) != 1}
    assert mixed == {}
    # Once settled, the group's own key refreshes into it again; the other key cannot.
    by_key = {u.json()["id"]: c for u, c in zip(users, clients, strict=True)}
    group, owners = next((g, k) for g, k in groups.items() if k & by_key.keys())
    (owner,) = owners
    assert by_key[owner].post("/rl/sessions", json={"group_id": group}).status_code == 201
    (other,) = by_key.keys() - {owner}
    again = by_key[other].post("/rl/sessions", json={"group_id": group})
    assert again.status_code == 403 and again.json()["error"]["code"] == "group_not_owned"
    for c in (*clients, admin):
        c.close()
