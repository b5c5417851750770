"""M3: one request cannot monopolise the engine. `n` x `max_tokens` is capped per
request (400 beyond), and a request's choices hold at most
`gateway.limits.max_choices_in_flight` of the engine's batch slots, so a small request is not
queued behind a greedy one."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.security_harness import serve_gateway

from engine.testing import start_engine_in_thread

ADMIN = {"authorization": "Bearer sk-test-admin"}


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "areal-policy", "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.fixture(scope="module")
def narrow_engine(tiny_model_dir: Path) -> Iterator[str]:
    """An engine that runs two sequences at once: easy to fill."""
    with start_engine_in_thread(tiny_model_dir, max_running_requests=2) as url:
        yield url


def test_n_times_max_tokens_is_capped(
    tmp_path: Path, tiny_model_dir: Path, narrow_engine: str
) -> None:
    with serve_gateway(
        tmp_path, tiny_model_dir, [narrow_engine], "gateway.limits.max_n_tokens=1000"
    ) as gw:
        url = gw.url + "/v1/chat/completions"
        r = httpx.post(url, headers=ADMIN, json=_chat(n=128, max_tokens=4000), timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "too_many_tokens_requested"
        assert r.json()["error"]["param"] == "max_tokens"
        r = httpx.post(url, headers=ADMIN, json=_chat(n=129, max_tokens=1), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        # Without max_tokens the default budget shrinks to fit: 4 choices of <= 250.
        r = httpx.post(url, headers=ADMIN, json=_chat(n=4, ignore_eos=True), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 1000


def test_a_small_request_is_not_queued_behind_a_greedy_one(
    tmp_path: Path, tiny_model_dir: Path, narrow_engine: str
) -> None:
    with serve_gateway(
        tmp_path,
        tiny_model_dir,
        [narrow_engine],
        "gateway.sampling.mode=client",
        "gateway.limits.max_choices_in_flight=1",
    ) as gw:
        url = gw.url + "/v1/chat/completions"
        greedy_done = threading.Event()

        def greedy() -> None:
            r = httpx.post(
                url,
                headers=ADMIN,
                timeout=300,
                json=_chat(n=4, max_tokens=1500, ignore_eos=True, temperature=1.0),
            )
            assert r.status_code == 200, r.text
            greedy_done.set()

        thread = threading.Thread(target=greedy, daemon=True)
        thread.start()
        time.sleep(0.5)  # the greedy request's choices are running
        started = time.monotonic()
        r = httpx.post(url, headers=ADMIN, json=_chat(max_tokens=4), timeout=300)
        took = time.monotonic() - started
        assert r.status_code == 200, r.text
        assert not greedy_done.is_set(), "the greedy request ended first: no contention shown"
        thread.join(300)
        assert greedy_done.is_set()
        assert took < 5, took
