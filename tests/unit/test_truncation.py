"""Truncated outputs (no EOS) under `trainer.no_eos` and DAPO's overlong shaping, against
hand-computed values; the per-step line names the policy."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from areal_service.config import TrainerConfig
from areal_service.types import EpisodeGroup, TrainSequence
from trainer.metrics import MetricsWriter
from trainer.truncation import apply_no_eos, is_truncated, longest_output, overlong_shaping

EOS = frozenset({2})


def _seq(sid: str, output: tuple[int, ...]) -> TrainSequence:
    ids = (1, 1, *output)
    mask = (0, 0) + (1,) * len(output)
    return TrainSequence(
        session_id=sid,
        group_id="g",
        completion_ids=(f"c-{sid}",),
        input_ids=ids,
        loss_mask=mask,
        logprobs=(0.0,) * len(ids),
        versions=(0,) * len(ids),
        reward=0.0,
        temperature=1.0,
    )


def _group() -> EpisodeGroup:
    stopped, cut = _seq("a", (5, 6, 2)), _seq("b", (5, 6, 7, 8, 9))
    return EpisodeGroup(
        group_id="g",
        session_ids=("a", "b"),
        sequences=(stopped, cut),
        session_returns=(1.0, 1.0),
        staleness=0,
    )


def test_truncation_is_a_missing_final_eos():
    group = _group()
    assert [is_truncated(s, EOS) for s in group.sequences] == [False, True]
    assert [longest_output(s) for s in group.sequences] == [3, 5]


def test_train_keeps_the_truncated_as_they_are():
    group = _group()
    assert apply_no_eos([group], TrainerConfig(), EOS) == [group]  # the default


def test_mask_trains_no_token_of_a_truncated_sequence():
    (masked,) = apply_no_eos([_group()], TrainerConfig(no_eos="mask"), EOS)
    assert masked.sequences[0].loss_mask == (0, 0, 1, 1, 1)
    assert masked.sequences[1].loss_mask == (0,) * 7
    assert masked.session_returns == (1.0, 1.0)  # still in the group's baseline


def test_penalty_lowers_the_truncated_sessions_return():
    cfg = TrainerConfig(no_eos="penalty", no_eos_penalty=-0.75)
    (shaped,) = apply_no_eos([_group()], cfg, EOS)
    assert shaped.session_returns == (1.0, 0.25)


def test_dapo_overlong_shaping_closed_form():
    # L_max 5, buffer 2: free up to 3 tokens, then -1/2 per token, -1 beyond 5.
    assert [overlong_shaping(n, 5, 2) for n in (1, 3, 4, 5, 6)] == [0.0, 0.0, -0.5, -1.0, -1.0]
    cfg = TrainerConfig(overlong_buffer=2, overlong_max_tokens=5)
    (shaped,) = apply_no_eos([_group()], cfg, EOS)
    assert shaped.session_returns == (1.0, 0.0)  # 3 tokens: free; 5 tokens: -1
    with pytest.raises(ValidationError, match="together"):
        TrainerConfig(overlong_buffer=2)


def test_per_step_line_shows_the_no_eos_policy(tmp_path):
    writer = MetricsWriter(tmp_path, total_steps=None, no_eos="mask")
    metrics = dict.fromkeys(
        (
            "task_reward",
            "advantage",
            "loss",
            "approx_kl",
            "ref_kl",
            "clip_ratio",
            "entropy",
            "grad_norm",
            "episodes",
            "dropped_episodes",
            "avg_seq_len",
            "staleness_mean",
            "staleness_max",
            "tokens_per_s",
            "time_wait_s",
            "time_train_s",
            "time_publish_s",
        ),
        0.0,
    )
    metrics.update(no_eos_ratio=0.5, mismatch_kl=0.0123, mismatch_masked_ratio=0.25)
    line = writer.write(1, 1, metrics)
    writer.close()
    assert "no_eos 0.50 (mask)" in line and "mismatch 0.0123/0.250" in line
