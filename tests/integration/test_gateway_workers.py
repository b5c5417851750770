"""Several gateway processes sharing one store, started the way users start them:
`areal-service serve --set gateway.scale.workers=2` (two uvicorn workers on one port, the
local engine behind them), on SQLite and on PostgreSQL (two replicas on one PostgreSQL
behind one URL).

Checked: every acknowledged completion is stored exactly once under concurrent load
spread over both workers (fresh connections, streamed and not); a published version is
swapped once (the leader's), and every worker reports it live; a revoked key and an
ended session are refused by every worker within their cache bounds; `/metrics` sums
both workers; when the leader dies, the other worker takes the lease and swaps the
next version, again once; `serve` killed with SIGKILL takes its workers and engine
along."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from support.loopback import free_port, wait_gone

from areal_service.config import StoreConfig
from areal_service.episodes import build_sequences
from areal_service.store import TrajectoryStore
from areal_service.store.schema import CompletionRow, KeyCounterRow
from areal_service.types import WeightVersionRecord
from engine.testing import make_weight_variant
from launcher.processes import cli_argv

ADMIN = {"Authorization": "Bearer sk-test-admin"}
KEY_BOUND_S = 5.0 + 3.0  # KeyResolver's ttl_s, plus a reload and a loaded machine's slack
SESSION_BOUND_S = 1.0 + 3.0  # the session cache's ttl_s, likewise
LEASE_S = 2.0
SYNC_S = 0.2  # gateway.limits.key_limits_sync_s


def _serve(tmp_path: Path, model_dir: Path, store_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(tmp_path / "serve.log", "wb") as log:  # the child keeps its own copy
        proc = subprocess.Popen(
            cli_argv("serve", "--set", f"data_dir={tmp_path}", "--set", f"engine.model={model_dir}",
                     "--set", f"gateway.port={port}", "--set", f"engine.port={free_port()}",
                     "--set", "gateway.auth.admin_key=sk-test-admin", "--set", "gateway.scale.workers=2",
                     "--set", f"gateway.scale.leader_lease_s={LEASE_S}", "--set", f"store.url={store_url}",
                     "--set", f"gateway.limits.key_limits_sync_s={SYNC_S}",
                     # the revocation checks below send many refused keys from one address
                     "--set", "gateway.auth.free_failures=10000"),
            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with contextlib.suppress(ProcessLookupError):  # an engine child may outlive it
                os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("serve exited:\n" + (tmp_path / "serve.log").read_text())
        try:
            if len(_workers(url, "/health/liveness", {}, tries=12)) == 2:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    _stop(proc)
    pytest.fail("two workers did not come up:\n" + (tmp_path / "serve.log").read_text())


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _fresh(url: str) -> httpx.Client:
    """A client that opens a new connection per request, so requests spread over both
    workers (a kept connection stays on the worker that accepted it)."""
    return httpx.Client(base_url=url, timeout=60,
                        limits=httpx.Limits(max_keepalive_connections=0))


def _workers(url: str, path: str, headers: dict[str, str], *, tries: int,
             method: str = "GET", json: object = None) -> dict[str, list[int]]:
    """`tries` requests on fresh connections: worker pid -> statuses it answered."""
    seen: dict[str, list[int]] = {}
    with _fresh(url) as http:
        for _ in range(tries):
            resp = http.request(method, path, headers=headers, json=json)
            seen.setdefault(resp.headers["x-areal-worker"], []).append(resp.status_code)
    return seen


def _chat(http: httpx.Client, key: str, stream: bool) -> tuple[str | None, str]:
    """One chat; (acknowledged completion id or None, answering worker)."""
    body = {"model": "gpt-4o-mini", "max_tokens": 6, "stream": stream,
            "messages": [{"role": "user", "content": "count"}]}
    headers = {"Authorization": f"Bearer {key}"}
    if not stream:
        resp = http.post("/v1/chat/completions", json=body, headers=headers)
        return (resp.json()["id"] if resp.status_code == 200 else None,
                resp.headers["x-areal-worker"])
    ids, done = set(), False
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        for line in resp.iter_lines():
            done = done or line == "data: [DONE]"
            if line.startswith("data: {"):
                ids.add(re.search(r'"id":"([^"]+)"', line).group(1))
    ok = resp.status_code == 200 and done and len(ids) == 1
    return (ids.pop() if ok else None, resp.headers["x-areal-worker"])


def _status(url: str) -> dict[str, dict]:
    """/admin/status of each worker, by pid."""
    out: dict[str, dict] = {}
    with _fresh(url) as http:
        for _ in range(20):
            body = http.get("/admin/status", headers=ADMIN).json()
            out[str(body["worker_pid"])] = body
    return out


def _wait(what: str, condition, timeout_s: float) -> float:  # noqa: ANN001
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.2)
    return time.monotonic() - started


def _loaded_weights(tmp_path: Path, version: int) -> int:
    """How many times the engine loaded `version` (its log line per update)."""
    log = tmp_path / "logs" / "engine.log"
    return len(re.findall(rf"loaded weights from .* \(version {version}\)", log.read_text()))


def _publish(store: TrajectoryStore, tmp_path: Path, model_dir: Path, version: int) -> None:
    path = make_weight_variant(model_dir, tmp_path / f"v{version}", seed=version)
    store.add_weight_version(WeightVersionRecord(version=version, path=str(path)))


def _one_client_per_worker(url: str) -> list[httpx.Client]:
    """Two kept-alive clients whose connections two different workers accepted (opened
    at once; a connection stays on its worker)."""
    clients = [httpx.Client(base_url=url, timeout=60) for _ in range(16)]
    answered: dict[int, str] = {}

    def probe(i: int) -> None:
        answered[i] = clients[i].get("/health/liveness").headers["x-areal-worker"]

    for _ in range(5):
        threads = [threading.Thread(target=probe, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        by_worker = {worker: clients[i] for i, worker in answered.items()}
        if len(by_worker) == 2:
            keep = list(by_worker.values())
            for c in clients:
                if c not in keep:
                    c.close()
            return keep
    pytest.fail(f"all connections went to one worker: {answered}")


def _one_sequence_across_workers(url: str, store: TrajectoryStore) -> None:
    session = httpx.post(f"{url}/rl/sessions", json={}, headers=ADMIN).json()
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    messages: list[dict] = [{"role": "system", "content": "You are terse."}]
    clients = _one_client_per_worker(url)
    workers: list[str] = []
    for turn in range(6):  # each turn on the other worker
        messages.append({"role": "user", "content": f"turn {turn}"})
        resp = clients[turn % 2].post("/v1/chat/completions", headers=headers, json={
            "model": "my-agent", "max_tokens": 6, "messages": messages})
        assert resp.status_code == 200, resp.text
        workers.append(resp.headers["x-areal-worker"])
        messages.append({k: v for k, v in resp.json()["choices"][0]["message"].items()
                         if v is not None})
    for c in clients:
        c.close()
    assert all(a != b for a, b in itertools.pairwise(workers)), workers
    records = store.list_completions(session["session_id"])
    assert len(records) == len(workers)
    sequences = build_sequences(records, {r.id: 0.0 for r in records})
    assert len(sequences) == 1, (workers, [r.parent_id for r in records])
    assert sequences[0].input_ids == records[-1].prompt_ids + records[-1].output_ids


def _until_both_synced(store: TrajectoryStore, key_id: str) -> None:
    """Both workers published 2 requests of `key_id`, then each exchanged again (and so
    read the other's count)."""
    def rows() -> list:
        with store.engine.connect() as db:
            return db.execute(select(KeyCounterRow.requests, KeyCounterRow.updated_at)
                              .where(KeyCounterRow.key_id == key_id)).all()

    _wait("both workers' counts published",
          lambda: sorted(r.requests for r in rows()) == [2, 2], 30)
    published = max(r.updated_at for r in rows())
    _wait("both workers read the other's", lambda: min(r.updated_at for r in rows())
          > published, 30)


def _rate_limit_across_workers(url: str, store: TrajectoryStore) -> None:
    key = httpx.post(f"{url}/admin/keys", json={"name": "limited", "rpm_limit": 4},
                     headers=ADMIN).json()
    headers = {"Authorization": f"Bearer {key['api_key']}"}
    body = {"model": "my-agent", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}
    clients = _one_client_per_worker(url)
    try:
        statuses = [c.post("/v1/chat/completions", json=body, headers=headers).status_code
                    for c in clients for _ in range(2)]
        assert statuses == [200] * 4  # two on each worker: four a minute in all
        _until_both_synced(store, key["id"])
        refused = [c.post("/v1/chat/completions", json=body, headers=headers)
                   for c in clients]
        assert [r.status_code for r in refused] == [429, 429], [r.text for r in refused]
        assert {r.json()["error"]["code"] for r in refused} == {"rate_limit_exceeded"}
    finally:
        for c in clients:
            c.close()


def _run_scenario(tmp_path: Path, model_dir: Path, store_url: str) -> None:
    proc, url = _serve(tmp_path, model_dir, store_url)
    store = TrajectoryStore.open(store_url, StoreConfig())
    try:
        key = httpx.post(f"{url}/admin/keys", json={"name": "agents"}, headers=ADMIN).json()

        # 1. Load over both workers: each acknowledged completion stored exactly once.
        acked: list[str] = []
        served: Counter[str] = Counter()
        failures: list[str] = []

        def agent(i: int) -> None:
            with _fresh(url) as http:
                for turn in range(6):
                    cid, worker = _chat(http, key["api_key"], stream=(i + turn) % 2 == 0)
                    served[worker] += 1
                    (acked.append(cid) if cid else failures.append(f"agent {i} turn {turn}"))

        threads = [threading.Thread(target=agent, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures
        assert len(served) == 2, f"one worker served everything: {served}"
        with store.engine.connect() as db:
            stored = db.execute(select(CompletionRow.id, CompletionRow.api_key_id)).all()
        assert sorted(cid for cid, _ in stored) == sorted(acked)  # none lost, none twice
        assert {key_id for _, key_id in stored} == {key["id"]}

        # /metrics sums both workers (each scrape answered by either one).
        with _fresh(url) as http:
            for _ in range(4):
                text = http.get("/metrics", headers=ADMIN).text
                total = sum(float(v) for v in re.findall(
                    r'^areal_requests_total\{route="chat",status="200"\} (\S+)$', text, re.M))
                assert total == len(acked), text[:2000]

        # A multi-turn session whose turns hop between the workers merges into ONE
        # training sequence: each worker continues the other's turn from the store.
        _one_sequence_across_workers(url, store)

        # A per-key rate limit counts both workers' requests, not each worker's own.
        _rate_limit_across_workers(url, store)

        # 2. One swap per publish, every worker sees it live.
        statuses: dict[str, dict] = {}
        _wait("both workers answered /admin/status",
              lambda: len(statuses.update(_status(url)) or statuses) == 2, 30)
        leaders = [pid for pid, s in statuses.items() if s["leader"]]
        assert len(leaders) == 1, statuses
        _publish(store, tmp_path, model_dir, 1)
        _wait("v1 live on both workers",
              lambda: {s["live_version"] for s in _status(url).values()} == {1}, 60)
        time.sleep(1.0)  # a second swap would come within a poll interval
        assert _loaded_weights(tmp_path, 1) == 1

        # 3. A revoked key is refused by every worker within the key cache's bound.
        assert {tuple(set(v)) for v in _workers(
            url, "/v1/models", {"Authorization": f"Bearer {key['api_key']}"},
            tries=10).values()} == {(200,)}
        revoked_at = time.monotonic()
        assert httpx.post(f"{url}/admin/keys/{key['id']}/revoke",
                          headers=ADMIN).status_code == 200
        took = _wait("the revoked key refused on both workers", lambda: _refused_by_both(
            url, "/v1/models", {"Authorization": f"Bearer {key['api_key']}"}), KEY_BOUND_S)
        assert time.monotonic() - revoked_at <= KEY_BOUND_S, took

        # 4. An ended session is refused by every worker within the session bound.
        started = httpx.post(f"{url}/rl/sessions", json={}, headers=ADMIN).json()
        session_key = {"Authorization": f"Bearer {started['api_key']}"}
        chat = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        assert {tuple(set(v)) for v in _workers(url, "/v1/chat/completions", session_key,
                                                tries=6, method="POST", json=chat).values()
                } == {(200,)}
        ended = httpx.post(f"{url}/rl/sessions/{started['session_id']}/end", headers=ADMIN)
        assert ended.status_code == 200, ended.text
        _wait("the ended session refused on both workers", lambda: _refused_by_both(
            url, "/v1/chat/completions", session_key, method="POST", json=chat),
            SESSION_BOUND_S)

        # 5. The leader dies: uvicorn restarts a worker, the lease moves (or comes back),
        # and the next version is again swapped exactly once.
        os.kill(int(leaders[0]), signal.SIGKILL)
        _wait("a new leader", lambda: _one_leader_among_two(url, gone=leaders[0]),
              LEASE_S * 3 + 30)
        _publish(store, tmp_path, model_dir, 2)
        _wait("v2 live on both workers",
              lambda: {s["live_version"] for s in _status(url).values()} == {2}, 60)
        time.sleep(1.0)
        assert _loaded_weights(tmp_path, 2) == 1

        # 6. `serve` killed outright: its workers and its engine go with it (an orphaned
        # worker would keep answering on the port).
        children = [int(pid) for pid in _status(url)]
        engine = re.search(r"started engine \(pid (\d+)\)",
                           (tmp_path / "serve.log").read_text())
        assert engine, (tmp_path / "serve.log").read_text()
        children.append(int(engine.group(1)))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert all(wait_gone(pid, 20) for pid in children), children
    finally:
        store.close()
        if proc.poll() is None:
            _stop(proc)
        else:  # after the kill above, or a failure: nothing of its group may linger
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def _refused_by_both(url: str, path: str, headers: dict[str, str], *, method: str = "GET",
                     json: object = None) -> bool:
    seen = _workers(url, path, headers, tries=10, method=method, json=json)
    return len(seen) == 2 and all(s >= 400 for statuses in seen.values() for s in statuses)


def _one_leader_among_two(url: str, gone: str) -> bool:
    statuses = _status(url)
    return (len(statuses) == 2 and gone not in statuses
            and sum(s["leader"] for s in statuses.values()) == 1)


def test_two_workers_on_sqlite(tmp_path: Path, tiny_model_dir: Path) -> None:
    _run_scenario(tmp_path, tiny_model_dir, f"sqlite:///{tmp_path / 'areal.db'}")


@pytest.mark.postgres
def test_two_replicas_on_postgres(tmp_path: Path, tiny_model_dir: Path, postgres_url: str) -> None:
    _run_scenario(tmp_path, tiny_model_dir, postgres_url)
