"""The gateway's own records of what a backend produced: a whole generation, one
streamed delta, and one swap's timings. Every engine client returns these whatever its
engine's wire format (`gateway/backends/`); nothing above the clients sees an engine's
reply shape."""

from __future__ import annotations

import time
from dataclasses import dataclass

from areal_service.sglang_protocol import FinishReason, TopLogprobs


@dataclass(frozen=True, slots=True)
class Generation:
    """A completion across any number of abort/resubmit rounds."""

    rid: str
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    output_versions: tuple[int, ...]
    """Policy version that produced each output token (`parse_version`)."""
    finish_reason: FinishReason
    """stop or length (an abort is resubmitted; too many aborts raise)."""
    prompt_tokens: int
    """Length of the caller's prompt (not of the resubmitted ones)."""
    resubmissions: int
    latency_s: float
    output_top_logprobs: tuple[TopLogprobs, ...] = ()
    backend: str = ""
    """Base URL of the backend that generated it."""

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


@dataclass(frozen=True, slots=True)
class GenerationDelta:
    """New tokens of one stream chunk; `finish_reason` is set on the last delta only."""

    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    output_versions: tuple[int, ...]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    """Cumulative over the whole generation, resubmissions included."""
    resubmissions: int
    output_top_logprobs: tuple[TopLogprobs, ...] = ()
    backend: str = ""
    """Base URL of the backend that generated it."""


@dataclass(frozen=True, slots=True)
class SwapTimings:
    """Seconds spent in each phase of one backend's weight swap."""

    pause_s: float
    update_s: float
    continue_s: float
    total_s: float

    @classmethod
    def load_only(cls, since: float) -> SwapTimings:
        """A swap that only loaded (no pause, no continue), begun at `since`
        (`time.perf_counter()`)."""
        total = time.perf_counter() - since
        return cls(pause_s=0.0, update_s=total, continue_s=0.0, total_s=total)
