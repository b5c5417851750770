"""A client that goes away mid-stream: the gateway aborts the backend generation at once
(not after SGLang's own ~2 s disconnect timer) and records nothing, since nothing was
acknowledged. The backend is the echo backend: a real engine cannot be made to generate
for ten seconds on demand, and what is checked is the gateway's abort."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.harness import ADMIN_KEY, run_gateway, stored_completions

from engine.echo_backend import EchoBackendHandle, start_echo_backend


@pytest.fixture()
def slow_echo() -> Iterator[EchoBackendHandle]:
    """1000 tokens at 10 ms each: ten seconds unless aborted; SGLang-like 2 s abort on a
    dropped connection, so an abort within 1 s can only come from the gateway."""
    with start_echo_backend(tokens=1000, token_delay_ms=10, disconnect_abort_ms=5000) as echo:
        yield echo


def test_client_leaving_mid_stream_aborts_the_generation(
    tmp_path: Path, tiny_model_dir: Path, slow_echo: EchoBackendHandle
) -> None:
    backend = slow_echo.backend
    assert backend is not None
    with run_gateway(tmp_path, tiny_model_dir, [slow_echo.url]) as gw:
        body = {
            "model": gw.config.gateway.model_name,
            "stream": True,
            "max_tokens": 1000,
            "messages": [{"role": "user", "content": "go on"}],
        }
        with httpx.stream(
            "POST",
            gw.v1 + "/chat/completions",
            json=body,
            timeout=30,
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        ) as response:
            assert response.status_code == 200
            chunks = response.iter_raw()
            next(chunks)  # the stream is flowing
            while not any(run.produced >= 5 for run in backend.running.values()):
                next(chunks)
            assert len(backend.running) == 1
            run = next(iter(backend.running.values()))
        left = time.monotonic()  # the `with` closed the connection
        while backend.running and time.monotonic() - left < 3:
            time.sleep(0.01)
        assert not backend.running, "the backend still generates for a client that left"
        assert time.monotonic() - left < 1.0
        assert run.aborted and run.produced < 500
        assert stored_completions(gw.state.store) == []  # nothing was acknowledged


def test_client_timing_out_on_a_plain_request_aborts_the_generation(
    tmp_path: Path, tiny_model_dir: Path, slow_echo: EchoBackendHandle
) -> None:
    """Not streamed: an agent framework's read timeout (then a retry) must not leave the
    abandoned generation running on the backend."""
    backend = slow_echo.backend
    assert backend is not None
    with run_gateway(tmp_path, tiny_model_dir, [slow_echo.url]) as gw:
        body = {
            "model": gw.config.gateway.model_name,
            "max_tokens": 1000,
            "messages": [{"role": "user", "content": "go on"}],
        }
        seen: list[Any] = []  # the run, taken while it runs (it may end at once after)

        def watch() -> None:
            end = time.monotonic() + 10
            while not backend.running and time.monotonic() < end:
                time.sleep(0.005)
            seen.extend(backend.running.values())

        watcher = threading.Thread(target=watch)
        watcher.start()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                gw.v1 + "/chat/completions",
                json=body,
                timeout=httpx.Timeout(30, read=0.5),
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            )
        left = time.monotonic()
        watcher.join()
        run = seen[0] if seen else None
        while backend.running and time.monotonic() - left < 3:
            time.sleep(0.01)
        assert not backend.running, "the backend still generates for a client that left"
        assert time.monotonic() - left < 1.0
        assert run is not None and run.aborted and run.produced < 500
        assert stored_completions(gw.state.store) == []
        metrics = httpx.get(
            gw.url + "/metrics",
            timeout=10,
            headers={
                "authorization": f"Bearer {gw.config.gateway.auth.admin_key.get_secret_value()}"
            },
        ).text
        assert 'areal_requests_total{route="chat",status="499"} 1.0' in metrics


def test_stream_client_leaving_during_a_long_prefill_aborts_it(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """No byte has been sent yet (the first token is ten seconds away): the client's
    departure is still noticed and the generation aborted."""
    with (
        start_echo_backend(delay_ms=10_000, disconnect_abort_ms=5000) as echo,
        run_gateway(tmp_path, tiny_model_dir, [echo.url]) as gw,
    ):
        backend = echo.backend
        assert backend is not None
        body = {
            "model": gw.config.gateway.model_name,
            "stream": True,
            "max_tokens": 10,
            "messages": [{"role": "user", "content": "go on"}],
        }
        seen: list[object] = []
        stop = threading.Event()

        def spy() -> None:  # the runs the backend had while the client waited
            while not stop.is_set():
                seen.extend(r for r in list(backend.running.values()) if r not in seen)
                time.sleep(0.01)

        spying = threading.Thread(target=spy, daemon=True)
        spying.start()
        with pytest.raises(httpx.ReadTimeout):
            with httpx.stream(
                "POST",
                gw.v1 + "/chat/completions",
                json=body,
                timeout=httpx.Timeout(30, read=0.5),
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            ) as response:
                response.read()
        left = time.monotonic()
        while backend.running and time.monotonic() - left < 3:
            time.sleep(0.01)
        stop.set()
        spying.join()
        assert not backend.running and time.monotonic() - left < 1.0
        assert len(seen) == 1 and seen[0].aborted  # it was running, and was aborted
        assert stored_completions(gw.state.store) == []


def test_finished_requests_leave_no_cyclic_garbage(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The disconnect watch of a request that completed ends without a cycle: nothing of
    the gateway's (or a CancelledError and its frames) waits for the GC to be freed.
    Such a cycle per request kept each request's objects alive until a collection and
    was the largest source of young-generation collections under load."""
    with (
        start_echo_backend(tokens=8) as echo,
        run_gateway(tmp_path, tiny_model_dir, [echo.url]) as gw,
    ):
        body = {
            "model": gw.config.gateway.model_name,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
        }
        auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(timeout=30) as client:

            def requests() -> None:
                for stream in (False, True) * 5:
                    reply = client.post(
                        gw.v1 + "/chat/completions", headers=auth, json={**body, "stream": stream}
                    )
                    assert reply.status_code == 200

            requests()  # warm: first-use caches and pools
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                requests()
                time.sleep(0.2)  # the last request's tasks end
                gc.collect()
                left = [
                    type(o).__qualname__
                    for o in gc.garbage
                    if isinstance(o, BaseException)
                    or type(o).__module__.startswith(("gateway", "uvicorn"))
                    or (type(o).__name__ == "coroutine" and "gateway" in o.cr_code.co_filename)
                ]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
        assert left == []
