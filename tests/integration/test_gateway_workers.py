"""Several gateway processes sharing one store, started the way users start them:
`areal-service serve --set gateway.scale.workers=2` (two uvicorn workers on one port, the
local engine behind them), on SQLite and on PostgreSQL (two replicas on one PostgreSQL
behind one URL).

One server per store (`served`, module-scoped) and one load over it (`load`), each test
checking one thing against them: every acknowledged completion is stored exactly once
under concurrent load spread over both workers (fresh connections, streamed and not);
`/metrics` sums both workers; a session hopping between workers is one sequence; a
per-key limit counts both; a published version is swapped once (the leader's), and every
worker reports it live; a revoked key and an ended session are refused by every worker
within their cache bounds; when the leader dies, the other worker takes the lease and
swaps the next version, again once; `serve` killed with SIGKILL takes its workers and
engine along. The last two change the shared server, so they come last in the file
(pytest runs a module's tests in file order)."""

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from support.loopback import free_port, wait_gone
from support.postgres_db import fresh_postgres_database

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
AGENTS, TURNS = 8, 6
"""The load: AGENTS threads of TURNS chats each, alternating streamed and not."""


def _serve(tmp_path: Path, model_dir: Path, store_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(tmp_path / "serve.log", "wb") as log:  # the child keeps its own copy
        proc = subprocess.Popen(
            cli_argv(
                "serve",
                "--no-train",  # the workers are the point here, not training
                "--set",
                f"data_dir={tmp_path}",
                "--set",
                f"engine.model={model_dir}",
                "--set",
                f"gateway.port={port}",
                "--set",
                f"engine.port={free_port()}",
                "--set",
                "gateway.auth.admin_key=sk-test-admin",
                "--set",
                "gateway.scale.workers=2",
                "--set",
                f"gateway.scale.leader_lease_s={LEASE_S}",
                "--set",
                f"store.url={store_url}",
                "--set",
                f"gateway.limits.key_limits_sync_s={SYNC_S}",
                # the revocation checks below send many refused keys from one address
                "--set",
                "gateway.auth.free_failures=10000",
            ),
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
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
    return httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0))


def _workers(
    url: str,
    path: str,
    headers: dict[str, str],
    *,
    tries: int,
    method: str = "GET",
    json: object = None,
) -> dict[str, list[int]]:
    """`tries` requests on fresh connections: worker pid -> statuses it answered."""
    seen: dict[str, list[int]] = {}
    with _fresh(url) as http:
        for _ in range(tries):
            resp = http.request(method, path, headers=headers, json=json)
            seen.setdefault(resp.headers["x-areal-worker"], []).append(resp.status_code)
    return seen


def _chat(http: httpx.Client, key: str, stream: bool) -> tuple[str | None, str]:
    """One chat; (acknowledged completion id or None, answering worker)."""
    body = {
        "model": "gpt-4o-mini",
        "max_tokens": 6,
        "stream": stream,
        "messages": [{"role": "user", "content": "count"}],
    }
    headers = {"Authorization": f"Bearer {key}"}
    if not stream:
        resp = http.post("/v1/chat/completions", json=body, headers=headers)
        return (
            resp.json()["id"] if resp.status_code == 200 else None,
            resp.headers["x-areal-worker"],
        )
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
        resp = clients[turn % 2].post(
            "/v1/chat/completions",
            headers=headers,
            json={"model": "my-agent", "max_tokens": 6, "messages": messages},
        )
        assert resp.status_code == 200, resp.text
        workers.append(resp.headers["x-areal-worker"])
        messages.append(
            {k: v for k, v in resp.json()["choices"][0]["message"].items() if v is not None}
        )
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
            return db.execute(
                select(KeyCounterRow.requests, KeyCounterRow.updated_at).where(
                    KeyCounterRow.key_id == key_id
                )
            ).all()

    _wait(
        "both workers' counts published", lambda: sorted(r.requests for r in rows()) == [2, 2], 30
    )
    published = max(r.updated_at for r in rows())
    _wait(
        "both workers read the other's", lambda: min(r.updated_at for r in rows()) > published, 30
    )


def _rate_limit_across_workers(url: str, store: TrajectoryStore) -> None:
    key = httpx.post(
        f"{url}/admin/keys", json={"name": "limited", "rpm_limit": 4}, headers=ADMIN
    ).json()
    headers = {"Authorization": f"Bearer {key['api_key']}"}
    body = {"model": "my-agent", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    clients = _one_client_per_worker(url)
    try:
        statuses = [
            c.post("/v1/chat/completions", json=body, headers=headers).status_code
            for c in clients
            for _ in range(2)
        ]
        assert statuses == [200] * 4  # two on each worker: four a minute in all
        _until_both_synced(store, key["id"])
        refused = [c.post("/v1/chat/completions", json=body, headers=headers) for c in clients]
        assert [r.status_code for r in refused] == [429, 429], [r.text for r in refused]
        assert {r.json()["error"]["code"] for r in refused} == {"rate_limit_exceeded"}
    finally:
        for c in clients:
            c.close()


def _refused_by_both(
    url: str, path: str, headers: dict[str, str], *, method: str = "GET", json: object = None
) -> bool:
    seen = _workers(url, path, headers, tries=10, method=method, json=json)
    return len(seen) == 2 and all(s >= 400 for statuses in seen.values() for s in statuses)


def _leaders(url: str) -> list[str]:
    """Pids of the workers that hold the leader lease, once both answered /admin/status."""
    statuses: dict[str, dict] = {}
    _wait(
        "both workers answered /admin/status",
        lambda: len(statuses.update(_status(url)) or statuses) == 2,
        30,
    )
    return [pid for pid, s in statuses.items() if s["leader"]]


def _one_leader_among_two(url: str, gone: str) -> bool:
    statuses = _status(url)
    return (
        len(statuses) == 2
        and gone not in statuses
        and sum(s["leader"] for s in statuses.values()) == 1
    )


# ---- the shared server and load -----------------------------------------------------


@dataclass
class Served:
    """`serve` with two workers, its store, and where it keeps its logs."""

    proc: subprocess.Popen
    url: str
    store: TrajectoryStore
    data_dir: Path
    model_dir: Path
    versions: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    """The next weight version to publish (the tests publish in turn)."""

    def publish(self) -> int:
        version = next(self.versions)
        _publish(self.store, self.data_dir, self.model_dir, version)
        return version


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Served]:
    """Two workers on one port and one store (a fresh PostgreSQL database, or SQLite)."""
    data_dir = tmp_path_factory.mktemp(f"workers-{request.param}")
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            store_url = f"sqlite:///{data_dir / 'areal.db'}"
        else:
            store_url = stack.enter_context(contextlib.contextmanager(fresh_postgres_database)())
        proc, url = _serve(data_dir, tiny_model_dir, store_url)
        store = TrajectoryStore.open(store_url, StoreConfig())
        try:
            yield Served(proc, url, store, data_dir, tiny_model_dir)
        finally:
            store.close()
            if proc.poll() is None:
                _stop(proc)
            else:  # killed by a test, or a failure: nothing of its group may linger
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)


@dataclass
class Load:
    """What the load left, read right after it (later tests add completions)."""

    key: dict
    acked: list[str]
    """Completion ids acknowledged to the agents."""
    failures: list[str]
    served_by: Counter[str]
    """Chats per answering worker."""
    stored: list[tuple[str, str]]
    """(completion id, key id) of every completion in the store."""
    metrics: list[str]
    """Four `/metrics` scrapes, each answered by either worker."""


@pytest.fixture(scope="module")
def load(served: Served) -> Load:
    """AGENTS agents of TURNS chats each, on fresh connections spread over both workers."""
    url = served.url
    key = httpx.post(f"{url}/admin/keys", json={"name": "agents"}, headers=ADMIN).json()
    acked: list[str] = []
    by_worker: Counter[str] = Counter()
    failures: list[str] = []

    def agent(i: int) -> None:
        with _fresh(url) as http:
            for turn in range(TURNS):
                cid, worker = _chat(http, key["api_key"], stream=(i + turn) % 2 == 0)
                by_worker[worker] += 1
                (acked.append(cid) if cid else failures.append(f"agent {i} turn {turn}"))

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(AGENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    with served.store.engine.connect() as db:
        stored = [
            tuple(row)
            for row in db.execute(select(CompletionRow.id, CompletionRow.api_key_id)).all()
        ]
    with _fresh(url) as http:
        metrics = [http.get("/metrics", headers=ADMIN).text for _ in range(4)]
    return Load(key, acked, failures, by_worker, stored, metrics)


# ---- the tests: one thing each ------------------------------------------------------


def test_every_chat_of_the_load_is_acknowledged(load: Load) -> None:
    assert not load.failures, load.failures


def test_the_load_spreads_over_both_workers(load: Load) -> None:
    assert len(load.served_by) == 2, f"one worker served everything: {load.served_by}"


def test_every_acknowledged_completion_is_stored_exactly_once(load: Load) -> None:
    assert sorted(cid for cid, _ in load.stored) == sorted(load.acked)  # none lost, none twice


def test_completions_are_stored_under_the_calling_key(load: Load) -> None:
    assert {key_id for _, key_id in load.stored} == {load.key["id"]}


def test_metrics_sum_both_workers(load: Load) -> None:
    for text in load.metrics:
        total = sum(
            float(v)
            for v in re.findall(
                r'^areal_requests_total\{route="chat",status="200"\} (\S+)$', text, re.M
            )
        )
        assert total == len(load.acked), text[:2000]


def test_a_session_hopping_between_workers_is_one_sequence(served: Served) -> None:
    """Each worker continues the other's turn from the store."""
    _one_sequence_across_workers(served.url, served.store)


def test_a_per_key_rate_limit_counts_both_workers(served: Served) -> None:
    _rate_limit_across_workers(served.url, served.store)


def test_one_worker_holds_the_leader_lease(served: Served) -> None:
    assert len(_leaders(served.url)) == 1


def test_a_published_version_is_swapped_once_and_live_on_every_worker(served: Served) -> None:
    version = served.publish()
    _wait(
        f"v{version} live on both workers",
        lambda: {s["live_version"] for s in _status(served.url).values()} == {version},
        60,
    )
    time.sleep(1.0)  # a second swap would come within a poll interval
    assert _loaded_weights(served.data_dir, version) == 1


def test_a_revoked_key_is_refused_by_every_worker_within_the_cache_bound(served: Served) -> None:
    url = served.url
    key = httpx.post(f"{url}/admin/keys", json={"name": "revoked"}, headers=ADMIN).json()
    bearer = {"Authorization": f"Bearer {key['api_key']}"}
    assert {tuple(set(v)) for v in _workers(url, "/v1/models", bearer, tries=10).values()} == {
        (200,)
    }
    revoked_at = time.monotonic()
    assert httpx.post(f"{url}/admin/keys/{key['id']}/revoke", headers=ADMIN).status_code == 200
    took = _wait(
        "the revoked key refused on both workers",
        lambda: _refused_by_both(url, "/v1/models", bearer),
        KEY_BOUND_S,
    )
    assert time.monotonic() - revoked_at <= KEY_BOUND_S, took


def test_an_ended_session_is_refused_by_every_worker_within_the_cache_bound(served: Served) -> None:
    url = served.url
    started = httpx.post(f"{url}/rl/sessions", json={}, headers=ADMIN).json()
    session_key = {"Authorization": f"Bearer {started['api_key']}"}
    chat = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    assert {
        tuple(set(v))
        for v in _workers(
            url, "/v1/chat/completions", session_key, tries=6, method="POST", json=chat
        ).values()
    } == {(200,)}
    ended = httpx.post(f"{url}/rl/sessions/{started['session_id']}/end", headers=ADMIN)
    assert ended.status_code == 200, ended.text
    _wait(
        "the ended session refused on both workers",
        lambda: _refused_by_both(
            url, "/v1/chat/completions", session_key, method="POST", json=chat
        ),
        SESSION_BOUND_S,
    )


# These two change the shared server: they stay last.


def test_when_the_leader_dies_another_takes_over_and_swaps_once(served: Served) -> None:
    """uvicorn restarts the killed worker; the lease moves (or comes back), and the next
    version is again swapped exactly once."""
    [leader] = _leaders(served.url)
    os.kill(int(leader), signal.SIGKILL)
    _wait("a new leader", lambda: _one_leader_among_two(served.url, gone=leader), LEASE_S * 3 + 30)
    version = served.publish()
    _wait(
        f"v{version} live on both workers",
        lambda: {s["live_version"] for s in _status(served.url).values()} == {version},
        60,
    )
    time.sleep(1.0)
    assert _loaded_weights(served.data_dir, version) == 1


def test_serve_killed_takes_its_workers_and_engine_along(served: Served) -> None:
    """An orphaned worker would keep answering on the port."""
    children = [int(pid) for pid in _status(served.url)]
    serve_log = (served.data_dir / "serve.log").read_text()
    engine = re.search(r"started engine \(pid (\d+)\)", serve_log)
    assert engine, serve_log
    children.append(int(engine.group(1)))
    os.kill(served.proc.pid, signal.SIGKILL)
    served.proc.wait(10)
    assert all(wait_gone(pid, 20) for pid in children), children
