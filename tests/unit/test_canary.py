"""The swap canary's records and rules (`areal_service/canary.py`) and the trainer's
stop rule after repeated refusals (`trainer/canary.py`)."""

from __future__ import annotations

import math

import pytest

from areal_service.canary import (
    FP32_TOLERANCE,
    LOW_PRECISION_TOLERANCE,
    CanarySequence,
    Fingerprint,
    max_abs_diff,
    tolerance,
)
from areal_service.config import SwapVerifyConfig, load_config
from areal_service.types import WeightVersionRecord
from trainer.canary import refusal_streak


def test_max_abs_diff_and_other_tokens():
    assert max_abs_diff([-1.0, -2.0], [-1.0, -2.5]) == 0.5
    assert max_abs_diff([-1.0], [-1.0, -2.0]) == math.inf  # scored other tokens


def test_tolerance_follows_the_dtypes_unless_set():
    cfg = SwapVerifyConfig()
    assert tolerance(cfg, "float32", "auto") == FP32_TOLERANCE
    assert tolerance(cfg, "float32", "float32") == FP32_TOLERANCE
    assert tolerance(cfg, "bfloat16", "auto") == LOW_PRECISION_TOLERANCE
    assert tolerance(cfg, "float32", "bfloat16") == LOW_PRECISION_TOLERANCE
    assert tolerance(SwapVerifyConfig(tolerance=0.02), "bfloat16", "auto") == 0.02
    # the measured gaps: fp32 agreement ~5e-6 and LoRA ~6e-7 pass; the smallest
    # previous-version gap measured (0.02) is refused
    assert 5e-6 < FP32_TOLERANCE < 0.02


def test_fingerprint_round_trip_and_contrast():
    fp = Fingerprint(
        sequences=[
            CanarySequence(ids=[1, 2, 3], start=1, logprobs=[-1.0, -2.0], previous=[-1.5, -2.0]),
            CanarySequence(ids=[4, 5], start=1, logprobs=[-0.5], previous=[-0.4]),
        ],
        dtype="float32",
    )
    back = Fingerprint.from_metadata({"canary": fp.model_dump()})
    assert back == fp and back.contrast() == 0.5
    assert Fingerprint.from_metadata({"step": 1}) is None


def test_config_section_is_read_and_checked():
    cfg = load_config(overrides=["swap_verify.enabled=true", "swap_verify.tolerance=0.05"])
    assert cfg.swap_verify.enabled and cfg.swap_verify.tolerance == 0.05
    with pytest.raises(Exception, match="tolerance"):
        load_config(overrides=["swap_verify.tolerance=0"])


def _row(version: int, verify: dict | None) -> WeightVersionRecord:
    meta = {} if verify is None else {"verify": verify}
    return WeightVersionRecord(version=version, path=f"/w/v{version}", metadata=meta)


REFUSED = {
    "refused": True,
    "tolerance": 0.001,
    "engines": {"http://e1": {"max_abs_diff": 0.3, "passed": False}},
}


def test_trainer_stops_after_max_failures_refusals_in_a_row():
    ok = {"refused": False, "engines": {}}
    # newest first; v5 not judged yet (skipped)
    rows = [_row(5, None), _row(4, REFUSED), _row(3, REFUSED), _row(2, ok), _row(1, REFUSED)]
    assert refusal_streak(rows, 3) is None  # v2 passed between
    why = refusal_streak(rows, 2)
    assert why is not None and "v4: http://e1 0.3" in why and "v3" in why
    assert "refused the last 2 published versions of policy default" in why
    assert refusal_streak([_row(1, REFUSED)], 2) is None  # not enough verdicts yet
