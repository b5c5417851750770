"""Property-based fuzzing of every public route (schemathesis, from the served
`/openapi.json`): bodies, query and path parameters generated from the schema, valid
and invalid, sent over real HTTP to a gateway (in front of the echo backend, so a
generated chat costs microseconds of "model"). Nothing may answer >= 500, every
response must match its documented shape, and the gateway must be live and ready
afterwards. Bounded: `POSITIVE` + `NEGATIVE` examples per operation (21 operations),
derandomized (the same examples every run), well under a minute per store: SQLite and
PostgreSQL (skipped without a server)."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from support.harness import ADMIN_KEY, run_gateway
from support.postgres_db import fresh_postgres_database

from engine.echo_backend import start_echo_backend

POSITIVE = 12
"""Schema-valid examples per operation."""
NEGATIVE = 8
"""Schema-violating examples per operation (wrong types, missing fields, bad paths)."""
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def fuzzed_gateway(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[str]:
    """The gateway on each store backend (PostgreSQL refuses what SQLite takes, e.g. a
    NUL in a string: the fuzz must find no 500 on either)."""
    with contextlib.ExitStack() as stack:
        store = (
            [f"store.url={stack.enter_context(_postgres())}"] if request.param == "postgres" else []
        )
        echo = stack.enter_context(start_echo_backend(tokens=4))
        gw = stack.enter_context(
            run_gateway(
                tmp_path_factory.mktemp("fuzz"),
                tiny_model_dir,
                [echo.url],
                "gateway.sampling.default_max_tokens=4",
                *store,
            )
        )
        yield gw.url


@contextlib.contextmanager
def _postgres() -> Iterator[str]:
    databases = fresh_postgres_database()  # skips without a server
    try:
        yield next(databases)
    finally:
        databases.close()


def _operations(url: str) -> list[schemathesis.specs.openapi.schemas.APIOperation]:
    loaded = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=ADMIN)
    return [result.ok() for result in loaded.get_all_operations()]


def _fuzz(
    operation, mode: GenerationMode, examples: int, statuses: Counter[int]
) -> tuple[int, list[str]]:
    """(examples sent, failure descriptions) for one operation in one mode."""
    sent, failures = 0, []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
    )
    def run(case: schemathesis.Case) -> None:
        nonlocal sent
        sent += 1
        response = case.call(headers=ADMIN, timeout=30)
        statuses[response.status_code] += 1
        if response.status_code >= 500:
            failures.append(
                f"{operation.label} [{mode.value}] -> {response.status_code}: "
                f"{response.text[:300]} (curl: {case.as_curl_command()[:400]})"
            )

    try:
        run()
    except Unsatisfiable:  # nothing to violate (no parameters, no body) in NEGATIVE mode
        assert mode is GenerationMode.NEGATIVE, operation.label
    return sent, failures


def test_no_route_answers_a_server_error(fuzzed_gateway: str) -> None:
    operations = _operations(fuzzed_gateway)
    labels = {op.label for op in operations}
    # Every public route is in the schema (the fuzzer's reach is the schema's).
    assert {
        "POST /v1/chat/completions",
        "POST /v1/responses",
        "POST /v1/rewards",
        "POST /rl/sessions",
        "GET /admin/keys",
        "GET /metrics",
    } <= labels, labels
    sent, failures, statuses = 0, [], Counter()
    started = time.monotonic()
    for operation in operations:
        for mode, examples in (
            (GenerationMode.POSITIVE, POSITIVE),
            (GenerationMode.NEGATIVE, NEGATIVE),
        ):
            n, failed = _fuzz(operation, mode, examples, statuses)
            sent += n
            failures += failed
    print(
        f"fuzzed {sent} requests over {len(operations)} operations in "
        f"{time.monotonic() - started:.1f} s: {dict(sorted(statuses.items()))}"
    )
    assert not failures, "\n".join(failures[:20])
    assert sent >= 200, sent


def test_gateway_is_healthy_after_fuzzing(fuzzed_gateway: str) -> None:
    # Runs after the fuzz items (file order): the same gateway still serves.
    assert httpx.get(f"{fuzzed_gateway}/health/liveness").status_code == 200
    ready = httpx.get(f"{fuzzed_gateway}/health/readiness")
    assert ready.status_code == 200, ready.text
    chat = httpx.post(
        f"{fuzzed_gateway}/v1/chat/completions",
        headers=ADMIN,
        timeout=30,
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 200, chat.text
