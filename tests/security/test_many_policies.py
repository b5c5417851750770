"""Issue 37, N4's cost: with many runtime policies the weight syncer read the store once
per policy per round (1,000 policies took the round from 0.1 to ~0.8 s), and each
creation rebuilt the whole registry. Now a round reads every policy's newest version in
one query, whatever the number of policies, and a creation validates only the new one.

The attack's shape at a size a test affords: 40 policies created over HTTP on loopback,
then the `weight_versions` reads of the running gateway's syncer counted for a second
(old behaviour: 40 a round). The 1,000-policy figures are `benchmarks/many_policies.py`'s."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
from sqlalchemy import event

from areal_service import policy_registry

ADMIN = {"authorization": "Bearer sk-test-admin"}
POLICIES = 40
POLL_S = 0.1


def test_the_syncer_reads_every_policys_version_in_one_query(
    serve: Callable[..., AbstractContextManager[Any]], monkeypatch: Any
) -> None:
    validated: list[str] = []
    original = policy_registry.policy_config

    def counting(record: Any) -> Any:
        validated.append(record.name)
        return original(record)

    monkeypatch.setattr(policy_registry, "policy_config", counting)
    with (
        serve(
            "default_policy.lora.rank=4",
            f"gateway.router.weight_poll_interval_s={POLL_S}",
        ) as gw,
        httpx.Client(base_url=gw.url, headers=ADMIN, timeout=60) as http,
    ):
        for i in range(POLICIES):
            made = http.post("/admin/policies", json={"name": f"tenant{i}"})
            assert made.status_code == 201, made.text
        # Each creation validated the new policy only (not all the ones before it).
        assert len(validated) <= 2 * POLICIES, len(validated)

        reads: list[str] = []
        lock = threading.Lock()

        def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if "weight_versions" in statement:
                with lock:
                    reads.append(statement)

        engine = gw.state.store.engine
        event.listen(engine, "before_cursor_execute", note)
        try:
            rounds_before = gw.state.metrics.registry.get_sample_value(
                "areal_weight_sync_round_seconds"
            )
            time.sleep(1.0)
        finally:
            event.remove(engine, "before_cursor_execute", note)
        assert rounds_before is not None  # the syncer runs
        rounds = 1.0 / POLL_S
        # Two reads a round (measured 18 in the second: the default policy's newest
        # version, and every named one's together); before, one per policy: 40 a round.
        assert 0 < len(reads) <= 3 * rounds, len(reads)
