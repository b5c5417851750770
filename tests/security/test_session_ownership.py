"""M5: a session derived from an agent's conversation id belongs to the key that opened
it. Another key naming it (`x-session-id`, `metadata.session_id`) gets 403 and writes
nothing there; the same conversation id under another key is a session of its own."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx

from gateway.auth import Principal
from gateway.sessions import client_session_id

ADMIN = {"authorization": "Bearer sk-test-admin"}


def _chat(gw: Any, headers: dict[str, str], **body: Any) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        headers=headers,
        timeout=60,
        json={
            "model": "areal-policy",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
            **body,
        },
    )


def test_another_key_cannot_write_into_the_admins_agent_session(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve() as gw:
        conversation = {"x-claude-code-session-id": "conv-1234abcd"}
        assert _chat(gw, {**ADMIN, **conversation}).status_code == 200
        admin_session = client_session_id(Principal(is_admin=True), "conv-1234abcd")
        store = gw.state.store
        assert len(store.list_completions(admin_session)) == 1

        user = httpx.post(
            gw.url + "/admin/keys", headers=ADMIN, json={"name": "u"}, timeout=10
        ).json()
        as_user = {"authorization": f"Bearer {user['api_key']}"}
        by_header = _chat(gw, {**as_user, "x-session-id": admin_session})
        assert by_header.status_code == 403, by_header.text
        assert by_header.json()["error"]["code"] == "session_forbidden"
        by_metadata = _chat(gw, as_user, metadata={"session_id": admin_session})
        assert by_metadata.status_code == 403, by_metadata.text
        # The same conversation id under the user's key: its own session.
        assert _chat(gw, {**as_user, **conversation}).status_code == 200
        assert len(store.list_completions(admin_session)) == 1


def test_a_group_a_user_key_named_first_is_not_the_admins(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve() as gw:
        http = httpx.Client(base_url=gw.url, timeout=30)
        user = http.post("/admin/keys", headers=ADMIN, json={"name": "u"}).json()
        as_user = {"authorization": f"Bearer {user['api_key']}"}
        squat = http.post("/rl/sessions", headers=as_user, json={"group_id": "grp-eval-1"})
        assert squat.status_code in (200, 201), squat.text
        admin = http.post(
            "/rl/sessions", headers=ADMIN, json={"group_id": "grp-eval-1", "group_size": 2}
        )
        assert admin.status_code == 409, admin.text
        assert admin.json()["error"]["code"] == "group_in_use"
        # A fresh group id, or one only the admin's sessions hold, is fine.
        for _ in range(2):
            ok = http.post(
                "/rl/sessions", headers=ADMIN, json={"group_id": "grp-eval-2", "group_size": 2}
            )
            assert ok.status_code == 201, ok.text
