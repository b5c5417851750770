"""The gateway's own records of what a backend produced: one round's reply or stream
chunk (`EngineReply`), a whole generation across rounds, one streamed delta, and one
swap's timings. Every engine client returns these whatever its engine's wire format
(`gateway/backends/`); nothing above the clients sees an engine's reply shape.

`EngineReply` is a Protocol so that each engine's edge pays one translation at most:
SGLang's parsed reply (`GenerateResponse`) has its shape already, and a client of
another engine builds a `TokenChunk` straight from its engine's reply."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from areal_service.sglang_protocol import FinishReason, TopLogprobs


class EngineReply(Protocol):
    """One round's reply, or one stream chunk: what interruptible generation reads."""

    @property
    def output_ids(self) -> Sequence[int]:
        """The output so far (`cumulative`), or only the chunk's new tokens."""

    @property
    def cumulative(self) -> bool:
        """Whether `output_ids` holds the whole output so far."""

    @property
    def finish_reason(self) -> FinishReason | None:
        """Set on a round's last reply only."""

    @property
    def weight_version(self) -> str:
        """The weights that produced these tokens (`parse_version` reads it)."""

    def output_logprobs(self, start: int = 0) -> tuple[float, ...]:
        """The logprob of each output token from `start` (finite: `LOGPROB_FLOOR`)."""

    def output_top_logprobs(self) -> tuple[TopLogprobs, ...]:
        """Per position, the (token_id, logprob) alternatives asked for."""

    def with_version(self, version: str) -> EngineReply:
        """This reply labelled `version` (a leased adapter's, not the server's label)."""


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """An `EngineReply` built by an engine client from its own engine's reply."""

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[TopLogprobs, ...]
    weight_version: str
    finish_reason: FinishReason | None = None
    cumulative: bool = True

    def output_logprobs(self, start: int = 0) -> tuple[float, ...]:
        return self.logprobs[start:] if start else self.logprobs

    def output_top_logprobs(self) -> tuple[TopLogprobs, ...]:
        return self.top_logprobs

    def with_version(self, version: str) -> TokenChunk:
        return dataclasses.replace(self, weight_version=version)


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
