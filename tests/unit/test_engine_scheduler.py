"""The engine scheduler's error barrier: a failing batch step ends only that batch's
requests, and the engine keeps serving. The fault is injected into the real runner
(a real engine cannot fail on demand); everything else is the tiny model on CPU."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_service.sglang_protocol import SamplingParams
from engine.scheduler import Request, Scheduler


@pytest.fixture
def scheduler(tiny_model_dir: Path) -> Iterator[Scheduler]:
    sched = Scheduler(
        str(tiny_model_dir), device="cpu", dtype="float32", max_running=8, weight_version="0"
    )
    sched.start()
    assert sched.ready.wait(120), sched.error
    yield sched
    sched.stop()


def submit(sched: Scheduler, rid: str, n: int) -> tuple[Request, threading.Event]:
    finished = threading.Event()
    holder: list[Request] = []

    def notify() -> None:
        if holder and holder[0].finish is not None:
            finished.set()

    req = Request(
        rid=rid,
        prompt_ids=[5, 17, 250, 33],
        params=SamplingParams(temperature=0),
        max_new_tokens=n,
        stop_token_ids=frozenset(),
        notify=notify,
        stream=False,
    )
    holder.append(req)
    sched.submit(req).result(10)
    return req, finished


def test_a_failing_step_aborts_its_batch_and_the_engine_keeps_serving(
    scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = scheduler.runner
    assert runner is not None
    real_decode = runner.decode
    calls = {"n": 0}

    def decode_failing_once(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected kernel failure")
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(runner, "decode", decode_failing_once)
    victim, victim_done = submit(scheduler, "victim", 50)
    assert victim_done.wait(60)
    assert victim.finish is not None and victim.finish.type == "abort"
    assert victim.finish.status_code == 500 and "injected" in (victim.finish.message or "")
    assert scheduler.alive and scheduler.error is None

    after, after_done = submit(scheduler, "after", 6)
    assert after_done.wait(60)
    assert after.finish is not None and after.finish.type == "length"
    assert len(after.output_ids) == 6
