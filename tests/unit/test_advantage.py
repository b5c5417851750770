"""Advantages against hand-computed values; degenerate groups give 0, never NaN. Also the
TrainerConfig section (defaults, the group-size rule, torch-free import)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_service.config import TrainerConfig
from areal_service.types import EpisodeGroup, TrainSequence
from trainer.advantage import (
    RunningBaseline,
    drgrpo,
    group_advantages,
    grpo,
    rloo,
    sequence_advantages,
)


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_grpo_uses_population_std():
    # r = [1, 0, 0, 1]: mean 0.5, population std 0.5 -> A = +-1 / (1 + 2 eps)
    out = grpo(_t(1, 0, 0, 1), eps=0.0)
    assert out.tolist() == [1.0, -1.0, -1.0, 1.0]
    # r = [3, 1]: mean 2, population std 1 (unbiased would be sqrt 2)
    out = grpo(_t(3, 1), eps=1e-6)
    assert out.tolist() == pytest.approx([1 / (1 + 1e-6), -1 / (1 + 1e-6)], abs=1e-15)


def test_grpo_three_values():
    # r = [0, 1, 5]: mean 2, var = (4 + 1 + 9)/3 = 14/3
    std = math.sqrt(14 / 3)
    out = grpo(_t(0, 1, 5), eps=0.1)
    assert out.tolist() == pytest.approx([-2 / (std + 0.1), -1 / (std + 0.1), 3 / (std + 0.1)])


def test_drgrpo_and_rloo():
    assert drgrpo(_t(0, 1, 5)).tolist() == pytest.approx([-2, -1, 3])
    # RLOO: 0 - (1+5)/2 = -3; 1 - (0+5)/2 = -1.5; 5 - (0+1)/2 = 4.5
    assert rloo(_t(0, 1, 5)).tolist() == pytest.approx([-3, -1.5, 4.5])


@pytest.mark.parametrize("fn", [lambda r: grpo(r, 1e-6), drgrpo, rloo])
def test_degenerate_groups_are_zero(fn):
    assert fn(_t(0.7)).tolist() == [0.0]
    # 0.1 * 3 does not sum exactly; the result must still be exactly zero
    assert fn(_t(0.1, 0.1, 0.1)).tolist() == [0.0, 0.0, 0.0]
    assert fn(_t(0.0, 0.0)).tolist() == [0.0, 0.0]


def test_group_advantages_dispatch_and_batch_norm():
    groups = [[1.0, 0.0], [0.0, 0.0, 3.0]]
    assert group_advantages(groups, "grpo", 0.0)[0] == [1.0, -1.0]
    assert group_advantages(groups, "drgrpo", 0.0) == [[0.5, -0.5], [-1.0, -1.0, 2.0]]
    # batch: all five returns [1, 0, 0, 0, 3]: mean 0.8, var = (0.04+0.64*3+4.84)/5 = 1.36
    std = math.sqrt(1.36)
    batch = group_advantages(groups, "batch", 0.0)
    assert [len(g) for g in batch] == [2, 3]
    flat = [a for g in batch for a in g]
    assert flat == pytest.approx([(r - 0.8) / std for r in (1, 0, 0, 0, 3)])
    assert group_advantages([[2.0], [2.0]], "batch", 1e-6) == [[0.0], [0.0]]


def _seq(session: str, reward: float) -> TrainSequence:
    return TrainSequence(
        session_id=session,
        group_id="g",
        completion_ids=("c",),
        input_ids=(1, 2),
        loss_mask=(0, 1),
        logprobs=(0.0, -1.0),
        versions=(-1, 0),
        reward=reward,
    )


def test_sequence_advantages_follow_their_session():
    # session b has two sequences (a prefix break); the discounted return of its
    # later sequence does not change its advantage.
    group = EpisodeGroup(
        group_id="g",
        session_ids=("a", "b"),
        sequences=(_seq("a", 1.0), _seq("b", 0.5), _seq("b", 0.0)),
        session_returns=(1.0, 0.0),
        staleness=0,
    )
    assert sequence_advantages([group], "grpo", 0.0) == [[1.0, -1.0, -1.0]]
    assert sequence_advantages([group], "rloo", 0.0) == [[1.0, -1.0, -1.0]]


def _solo(sid: str, value: float, task: str | None) -> EpisodeGroup:
    return EpisodeGroup(
        group_id=sid,
        session_ids=(sid,),
        sequences=(_seq(sid, value),),
        session_returns=(value,),
        staleness=0,
        grouped=False,
        task_id=task,
    )


def test_groups_of_one_get_the_batch_baseline_under_group_kinds():
    """An ungrouped session next to GRPO groups used to get A = 0 (nothing learnt)."""
    pair = EpisodeGroup(
        group_id="g",
        session_ids=("a", "b"),
        sequences=(_seq("a", 1.0), _seq("b", 0.0)),
        session_returns=(1.0, 0.0),
        staleness=0,
    )
    solos = [_solo("x", 3.0, "t"), _solo("y", 1.0, "t")]
    assert sequence_advantages([pair, *solos], "grpo", 0.0) == [[1.0, -1.0], [1.0], [-1.0]]
    # One alone in its step: centred on itself, 0 (a task_mean baseline learns across steps).
    assert sequence_advantages([solos[0]], "grpo", 1e-6) == [[0.0]]


def test_task_mean_baseline_is_a_running_mean_per_task():
    baseline = RunningBaseline(0.5)
    first = [_solo("x", 1.0, "t"), _solo("y", 0.0, "t"), _solo("z", 5.0, "u")]
    # First step: every task against the step's mean (2.0).
    assert sequence_advantages(first, "grpo", 1e-6, baseline) == [[-1.0], [-2.0], [3.0]]
    assert baseline.mean("t") == 0.5 and baseline.mean("u") == 5.0
    second = [_solo("w", 1.0, "t"), _solo("v", 3.0, "new")]
    # t against its own mean 0.5; the new task against the overall running mean 2.0.
    assert sequence_advantages(second, "grpo", 1e-6, baseline) == [[0.5], [1.0]]
    assert baseline.mean("t") == 0.5 * 0.5 + 0.5 * 1.0 and baseline.mean("new") == 3.0


def test_trainer_config_defaults_and_group_rule():
    cfg = TrainerConfig()
    assert cfg.advantage == "grpo" and cfg.eps_clip_higher is None and cfg.ref_model is None
    assert all(f.description for f in TrainerConfig.model_fields.values())
    assert TrainerConfig(advantage="batch", group_size=1).group_size == 1
    # Groups of one are no longer left with A = 0: they get the ungrouped baseline.
    assert TrainerConfig(advantage="grpo", group_size=1).ungrouped_baseline == "batch"


@pytest.mark.processes
def test_trainer_config_is_torch_free():
    code = "import sys, areal_service.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
