"""The trainer's `main` run to completion on a thread of the test process (beside an
in-process gateway and engine), its exception surfaced in the test."""

from __future__ import annotations

import threading

from areal_service.config import ServiceConfig


def train_in_thread(config: ServiceConfig, *, timeout_s: float) -> None:
    """`trainer.train.main(config)` until `trainer.total_steps`; AssertionError when it
    raised or has not finished within `timeout_s`."""
    from trainer.train import main  # torch: imported by the tests that train only

    failure: list[BaseException] = []

    def train() -> None:
        try:
            main(config)
        except BaseException as exc:  # surfaced by the assert below
            failure.append(exc)

    thread = threading.Thread(target=train, name="trainer")
    thread.start()
    thread.join(timeout=timeout_s)
    assert not thread.is_alive(), f"trainer did not finish {config.trainer.total_steps} steps"
    assert not failure, failure
