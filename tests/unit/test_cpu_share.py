"""Cores follow the work: each side takes every core while the other is idle, its share
while the other is busy; a side that died busy, or closed, leaves the cores to the other;
the launcher turns it on only where both sides can take part."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest
import torch

from areal_service.config import load_config
from areal_service.cpu_share import CpuShare
from launcher.stack import share_cpus


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_busy_side_takes_the_idle_sides_cores(tmp_path, threads):
    path = tmp_path / "cpu-share"
    engine = CpuShare(path, "engine", share=1, cores=2)
    trainer = CpuShare(path, "trainer", share=1, cores=2)
    assert trainer.follow(True) == 2 == torch.get_num_threads()  # the engine is idle
    assert engine.follow(True) == 1  # the trainer is busy: the engine keeps its share
    assert trainer.follow(True) == 1  # and now the trainer steps down to its own
    assert engine.follow(False) == 1
    assert trainer.follow(True) == 2
    engine.follow(True)
    engine.close()  # a stopped engine leaves every core to the trainer
    assert trainer.follow(True) == 2
    trainer.close()


@pytest.mark.processes
def test_a_side_that_died_busy_does_not_hold_the_other(tmp_path, threads):
    path = tmp_path / "cpu-share"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    trainer = CpuShare(path, "trainer", share=1, cores=2)
    with open(path, "r+b") as f:  # the engine's slot: busy, written by a dead process
        f.write(struct.pack("<qq", int(gone.stdout), 1))
    assert trainer.follow(True) == 2
    with open(path, "r+b") as f:  # the same, by a live one (this test)
        f.write(struct.pack("<qq", os.getpid(), 1))
    assert trainer.follow(True) == 1
    trainer.close()


def test_launcher_shares_only_a_local_engine_with_one_trainer(tmp_path):
    def decided(overrides: list[str], trainer_procs: int = 1) -> bool:
        tree = load_config(overrides=[f"data_dir={tmp_path}", *overrides]).model_dump()
        share_cpus(tree, trainer_procs)
        return tree["cpu_share"]

    assert decided([])
    assert not decided([], trainer_procs=2)
    assert not decided(["engine.backend=vllm"])
    assert not decided(["gateway.router.backends=[http://127.0.0.1:9]"])
    assert not decided(["gateway.router.url=http://127.0.0.1:9"])  # a router: no local engine
    assert not decided(["trainer.torch_threads=1"])  # the user chose the split


def test_the_demo_trains_on_policy_where_the_cores_are_shared(tmp_path):
    """η is the user's when given; otherwise 0 under the cores share (one set of cores runs
    both sides in turn, so staleness buys nothing) and the default elsewhere."""
    from launcher.demo import demo_config

    def eta(overrides: list[str], given: bool) -> int:
        config = load_config(overrides=[f"data_dir={tmp_path}", *overrides])
        return demo_config(config, steps=1, eta_given=given).trainer.max_staleness

    assert eta([], given=False) == 0
    assert eta(["trainer.max_staleness=3"], given=True) == 3
    assert eta(["engine.backend=vllm", "engine.vllm.python=/bin/true"], given=False) == 2
    assert eta(["trainer.torch_threads=1"], given=False) == 2  # the user split the cores
    # what `run_demo` reads as "given" (before `model_config` re-validates the config): the
    # fields the user's config or --set named
    assert (
        "max_staleness"
        in load_config(overrides=["trainer.max_staleness=2"]).trainer.model_fields_set
    )
    assert "max_staleness" not in load_config(overrides=[]).trainer.model_fields_set
