"""The gateway's task supervisor (`gateway/supervisor.py`): a task that raises or returns
is logged and started again after its backoff, shown in `problems` meanwhile, and
`stop` cancels every task."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.supervisor import Supervisor


def test_a_task_that_raises_or_returns_is_restarted_and_shown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs = {"raises": 0, "returns": 0}
    forever = asyncio.Event()

    async def raises() -> None:
        runs["raises"] += 1
        if runs["raises"] == 1:
            raise RuntimeError("boom")
        await forever.wait()

    async def returns() -> None:
        runs["returns"] += 1
        if runs["returns"] == 1:
            return
        await forever.wait()

    async def scenario() -> None:
        supervisor = Supervisor(backoff_s=0.2)
        supervisor.start("raises", raises)
        supervisor.start("returns", returns)
        await asyncio.sleep(0.05)  # both ended once and wait out their backoff
        assert supervisor.problems() == {
            "raises": "restarting after RuntimeError: boom",
            "returns": "restarting after it returned",
        }
        await asyncio.sleep(0.3)
        assert supervisor.problems() == {}
        assert runs == {"raises": 2, "returns": 2}
        assert {r.name: r.restarts for r in supervisor.tasks.values()} == {
            "raises": 1,
            "returns": 1,
        }
        await supervisor.stop()
        assert supervisor.problems() == {}

    with caplog.at_level(logging.ERROR, logger="gateway.supervisor"):
        asyncio.run(scenario())
    failed = [r for r in caplog.records if r.name == "gateway.supervisor"]
    assert [r.getMessage() for r in failed] == [
        "background task raises failed; starting it again",
        "background task returns returned; starting it again",
    ]
    assert failed[0].exc_info is not None  # the traceback is logged


def test_backoff_doubles_up_to_its_cap() -> None:
    starts: list[float] = []

    async def crashes() -> None:
        starts.append(asyncio.get_running_loop().time())
        raise RuntimeError("again")

    async def scenario() -> None:
        supervisor = Supervisor(backoff_s=0.05, max_backoff_s=0.1)
        supervisor.start("crashes", crashes)
        await asyncio.sleep(0.5)
        await supervisor.stop()

    logging.getLogger("gateway.supervisor").disabled = True
    try:
        asyncio.run(scenario())
    finally:
        logging.getLogger("gateway.supervisor").disabled = False
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps[0] == pytest.approx(0.05, abs=0.04)
    assert all(gap == pytest.approx(0.1, abs=0.05) for gap in gaps[1:3]), gaps


def test_a_watched_part_is_reported() -> None:
    supervisor = Supervisor()
    alive = [True]
    supervisor.watch("store_writer", lambda: None if alive[0] else "the thread ended")
    assert supervisor.problems() == {}
    alive[0] = False
    assert supervisor.problems() == {"store_writer": "the thread ended"}
