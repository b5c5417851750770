"""The swap canary's records, shared by the trainer (which computes a fingerprint with
each published version) and the gateway (which scores it on each engine after a swap):
what a fingerprint holds, how two sets of logprobs are compared, and the default
tolerance. Torch-free.

A fingerprint is small (a few prompts x a few tokens) and rides in the version row's
metadata under `canary`, so it is written in the same transaction that publishes the
version and cannot be separated from it. It holds the exact token ids scored (the
prompt rendered with the served chat template, then the fixed continuation): the
gateway scores ids, never text, so both sides score the same tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from areal_service.config import SwapVerifyConfig

FP32_TOLERANCE = 1e-3
"""float32 on both sides: the engine and the trainer agree to ~5e-6 (full weights) and
~6e-7 (LoRA vs PEFT); the previous version differs by 0.02 to 9.7."""
LOW_PRECISION_TOLERANCE = 0.1
"""bfloat16 / float16 on either side: rounding alone moves logprobs by a few
hundredths, so the check there catches gross errors (a wrong tensor, old weights after
a big step, an adapter at the wrong scale), not the smallest steps."""
_LOW_PRECISION = frozenset({"bfloat16", "float16"})


class CanarySequence(BaseModel):
    """One canary prompt: its ids (prompt then continuation) and the logprob of each
    continuation token (`ids[start:]`) given everything before it."""

    model_config = ConfigDict(frozen=True)
    ids: list[int] = Field(min_length=2)
    start: int = Field(ge=1)
    logprobs: list[float]
    previous: list[float] | None = None
    """The same tokens under the previous version (the contrast a check must beat)."""


class Fingerprint(BaseModel):
    """What the trainer publishes with a version (metadata `canary`)."""

    model_config = ConfigDict(frozen=True)
    sequences: list[CanarySequence] = Field(min_length=1)
    dtype: str
    """The trainer's compute dtype when it scored (float32, bfloat16)."""

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Fingerprint | None:
        """The row's fingerprint, None when it carries none (verification off, or a
        version published before it was on)."""
        raw = metadata.get("canary")
        return cls.model_validate(raw) if isinstance(raw, Mapping) else None

    def contrast(self) -> float | None:
        """Largest difference between this version's and the previous version's
        logprobs (None without the previous ones): how far a stale engine would be."""
        gaps = [
            max_abs_diff(s.logprobs, s.previous) for s in self.sequences if s.previous is not None
        ]
        return max(gaps) if gaps else None


def max_abs_diff(expected: Sequence[float], got: Sequence[float]) -> float:
    """Largest absolute difference; infinite when the lengths differ (an engine that
    scored other tokens is as wrong as it gets)."""
    if len(expected) != len(got):
        return float("inf")
    return max((abs(a - b) for a, b in zip(expected, got, strict=True)), default=0.0)


def tolerance(config: SwapVerifyConfig, trainer_dtype: str, engine_dtype: str) -> float:
    """The configured tolerance, else the default for these dtypes (`engine_dtype`
    "auto" counts as the trainer's: both resolve to the same by device)."""
    if config.tolerance is not None:
        return config.tolerance
    dtypes = {trainer_dtype, trainer_dtype if engine_dtype == "auto" else engine_dtype}
    return LOW_PRECISION_TOLERANCE if dtypes & _LOW_PRECISION else FP32_TOLERANCE
