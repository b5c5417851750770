"""`last_used_at` of keys: noted in memory per request, written off the request path at
most once per `gateway.auth.key_usage_interval_s`, shown by the admin API and the console."""

from __future__ import annotations

import re
import time

import httpx
from support.harness import ADMIN_KEY

from areal_service.store import TrajectoryStore
from gateway.auth import KeyUsage, write_key_usage

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.05)


def test_last_used_at_is_written_and_shown(tmp_path, tiny_model_dir, engine_url, gateway_factory):
    with gateway_factory(
        tmp_path, tiny_model_dir, [engine_url], "gateway.auth.key_usage_interval_s=0.3"
    ) as gw:
        http = httpx.Client(base_url=gw.url, timeout=30)
        created = http.post("/admin/keys", json={"name": "used"}, headers=ADMIN).json()
        unused = http.post("/admin/keys", json={"name": "unused"}, headers=ADMIN).json()
        before = time.time()
        user = {"authorization": f"Bearer {created['api_key']}"}
        assert http.get("/v1/models", headers=user).status_code == 200
        store = gw.state.store

        def used_at() -> float | None:
            return store.keys.get_api_key(created["id"]).last_used_at

        _wait_for(lambda: used_at() is not None)
        assert before - 1 <= used_at() <= time.time()
        assert store.keys.get_api_key(unused["id"]).last_used_at is None
        listed = {k["id"]: k for k in http.get("/admin/keys", headers=ADMIN).json()["data"]}
        assert listed[created["id"]]["last_used_at"] == used_at()
        # The console's keys page shows the time (UTC) instead of a dash.
        page = http.get("/console/login")
        token = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
        http.post("/console/login", data={"csrf_token": token, "admin_key": ADMIN_KEY})
        keys_page = http.get("/console/keys").text
        row = re.search(rf'<tr id="key-{created["id"]}".*?</tr>', keys_page, re.S).group(0)
        shown = time.strftime("%Y-%m-%d", time.gmtime(used_at()))
        assert row.count(shown) == 2, row  # created and last used
        unused_row = re.search(rf'<tr id="key-{unused["id"]}".*?</tr>', keys_page, re.S).group(0)
        assert unused_row.count(shown) == 1


def test_key_usage_is_throttled_per_key():
    usage = KeyUsage(min_interval_s=10)
    usage.note("a", now=100.0)
    usage.note("a", now=105.0)  # within the interval: not noted again
    usage.note("b", now=106.0)
    assert usage.take() == {"a": 100.0, "b": 106.0}
    usage.note("a", now=108.0)
    assert usage.take() == {}
    usage.note("a", now=111.0)
    assert usage.take() == {"a": 111.0}


async def test_flush_writes_one_batch_and_keeps_times_on_failure(tmp_path, monkeypatch):
    from areal_service.config import StoreConfig
    from areal_service.keys import new_api_key

    store = TrajectoryStore.open(f"sqlite:///{tmp_path}/k.db", StoreConfig())
    keys = [new_api_key(name=f"k{i}")[1] for i in range(3)]
    for record in keys:
        store.keys.add_api_key(record)
    usage = KeyUsage(min_interval_s=0)
    usage.note(keys[0].id, now=50.0)
    usage.note(keys[1].id, now=60.0)
    await write_key_usage(usage, store)
    assert [store.keys.get_api_key(k.id).last_used_at for k in keys] == [50.0, 60.0, None]
    store.keys.touch_api_keys({keys[0].id: 40.0})  # an older time never moves it back
    assert store.keys.get_api_key(keys[0].id).last_used_at == 50.0
    usage.note(keys[2].id, now=70.0)

    def locked(_: object) -> None:
        raise RuntimeError("database is locked")

    monkeypatch.setattr(store.keys, "touch_api_keys", locked)  # the write fails: times kept
    await write_key_usage(usage, store)
    assert usage.take() == {keys[2].id: 70.0}
    store.close()
