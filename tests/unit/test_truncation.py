"""Truncated outputs (they hit their token limit) under `trainer.no_eos` and DAPO's
overlong shaping, against hand-computed values; an output its stop string ended is not
truncated; the per-step line names the policy."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from areal_service.config import TrainerConfig
from areal_service.episodes import build_sequences
from areal_service.types import CompletionRecord, EpisodeGroup, TrainSequence
from trainer.metrics import MetricsWriter, batch_metrics
from trainer.truncation import apply_no_eos, is_truncated, longest_output, overlong_shaping


def _seq(sid: str, output: tuple[int, ...], truncated: bool) -> TrainSequence:
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
        truncated=truncated,
    )


def _group() -> EpisodeGroup:
    stopped, cut = _seq("a", (5, 6, 2), False), _seq("b", (5, 6, 7, 8, 9), True)
    return EpisodeGroup(
        group_id="g",
        session_ids=("a", "b"),
        sequences=(stopped, cut),
        session_returns=(1.0, 1.0),
        staleness=0,
    )


def _completion(cid: str, output: tuple[int, ...], finish: str, **links: str) -> CompletionRecord:
    prompt = (1, 1) if "parent_id" not in links else (1, 1, 5, 6, 1)
    return CompletionRecord(
        id=cid,
        model="m",
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=(0.0,) * len(output),
        output_versions=(0,) * len(output),
        finish_reason=finish,
        session_id="s",
        **links,
    )


def test_truncation_is_a_length_finish_not_a_missing_eos():
    """No output here ends on an EOS id: one ended on the client's stop string, one on a
    tool call, one hit its limit; a chain takes its last trained turn's reason."""
    records = [
        _completion("stop-string", (5, 6), "stop"),
        _completion("tool", (7, 8), "tool_calls"),
        _completion("cut", (5, 6, 7), "length"),
    ]
    sequences = build_sequences(records, dict.fromkeys((r.id for r in records), 1.0))
    assert [(s.completion_ids, is_truncated(s)) for s in sequences] == [
        (("stop-string",), False),
        (("tool",), False),
        (("cut",), True),
    ]
    # A cut first turn continued by a complete one: the sequence ends complete.
    chain = [
        _completion("t1", (5, 6), "length"),
        _completion("t2", (9,), "stop", parent_id="t1"),
    ]
    (merged,) = build_sequences(chain, {"t1": 1.0, "t2": 1.0})
    assert merged.completion_ids == ("t1", "t2") and not is_truncated(merged)
    group = _group()
    assert [is_truncated(s) for s in group.sequences] == [False, True]
    assert [longest_output(s) for s in group.sequences] == [3, 5]
    metrics = batch_metrics([group], [[0.0] * 5, [0.0] * 7], version=0)
    assert metrics["no_eos_ratio"] == 0.5


def test_train_keeps_the_truncated_as_they_are():
    group = _group()
    assert apply_no_eos([group], TrainerConfig()) == [group]  # the default


def test_mask_trains_no_token_of_a_truncated_sequence():
    (masked,) = apply_no_eos([_group()], TrainerConfig(no_eos="mask"))
    assert masked.sequences[0].loss_mask == (0, 0, 1, 1, 1)
    assert masked.sequences[1].loss_mask == (0,) * 7
    assert masked.session_returns == (1.0, 1.0)  # still in the group's baseline


def test_penalty_lowers_the_truncated_sessions_return():
    cfg = TrainerConfig(no_eos="penalty", no_eos_penalty=-0.75)
    (shaped,) = apply_no_eos([_group()], cfg)
    assert shaped.session_returns == (1.0, 0.25)


def test_dapo_overlong_shaping_closed_form():
    # L_max 5, buffer 2: free up to 3 tokens, then -1/2 per token, -1 beyond 5.
    assert [overlong_shaping(n, 5, 2) for n in (1, 3, 4, 5, 6)] == [0.0, 0.0, -0.5, -1.0, -1.0]
    cfg = TrainerConfig(overlong_buffer=2, overlong_max_tokens=5)
    (shaped,) = apply_no_eos([_group()], cfg)
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
