"""N8 (staleness gate on): one user key's refreshes fill at most its share of its
policy's window (`gateway.sessions.key_window_share`), so a co-tenant's key and the
admin still get places while no trainer drains it; past its share the key gets 429."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx

ADMIN = {"authorization": "Bearer sk-test-admin"}
GATE = (
    "gateway.sessions.staleness_gate=true",
    "gateway.sessions.admit_wait_s=0",
    "trainer.max_staleness=2",
    "trainer.batch_groups=4",
    "trainer.group_size=1",
)
"""A window of (2 + 0 + 1) * 4 = 12 sessions at version 0; a key's share: 6."""


def _key(http: httpx.Client, name: str) -> httpx.Client:
    created = http.post("/admin/keys", headers=ADMIN, json={"name": name})
    assert created.status_code == 201, created.text
    return httpx.Client(
        base_url=str(http.base_url),
        headers={"authorization": f"Bearer {created.json()['api_key']}"},
        timeout=60,
    )


def _refresh(client: httpx.Client) -> httpx.Response:
    return client.post("/rl/sessions", json={})


def test_one_key_cannot_fill_its_policys_window(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve(*GATE) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
        tenant_a, tenant_b = _key(http, "a"), _key(http, "b")
        codes = [_refresh(tenant_a).status_code for _ in range(12)]
        assert codes == [201] * 6 + [429] * 6, codes
        refused = _refresh(tenant_a)
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert "key_window_share" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1
        # The co-tenant and the admin still get the rest of the window...
        admin = http.post("/rl/sessions", headers=ADMIN, json={"group_size": 2})
        assert admin.status_code == 201, admin.text
        assert [_refresh(tenant_b).status_code for _ in range(4)] == [201] * 4
        # ...which is then full for everyone (the window itself is unchanged).
        full = _refresh(tenant_b)
        assert full.status_code == 429 and "is full" in full.json()["error"]["message"]
        tenant_a.close()
        tenant_b.close()


def test_a_share_of_one_is_the_old_window(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve(*GATE, "gateway.sessions.key_window_share=1") as gw:
        with httpx.Client(base_url=gw.url, timeout=60) as http:
            tenant = _key(http, "a")
            codes = [_refresh(tenant).status_code for _ in range(13)]
            assert codes == [201] * 12 + [429], codes
            tenant.close()
