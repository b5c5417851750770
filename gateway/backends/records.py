"""The gateway's own records of a generation: the request (`TokenRequest`), and what a
backend produced: one round's reply or stream chunk (`EngineReply`), a whole generation
across rounds, one streamed delta, and one swap's timings. Every engine client returns these whatever its engine's wire format
(`gateway/backends/`); nothing above the clients sees an engine's reply shape.

`EngineReply` is a Protocol so that each engine's edge pays one translation at most:
SGLang's parsed reply (`GenerateResponse`) has its shape already, and a client of
another engine builds a `TokenChunk` straight from its engine's reply."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from areal_service.sglang_protocol import FinishReason, SamplingParams, TopLogprobs

_UNSET: Any = object()


@dataclass(frozen=True, slots=True)
class TokenRequest:
    """One token-in generation as the gateway asks for it (one prompt, one choice); each
    engine client translates it into its engine's request at its edge. The sampling
    values are validated when the record is made (`for_tokens`), with the messages
    SGLang would answer 400 with."""

    input_ids: Sequence[int]
    sampling_params: SamplingParams
    rid: str
    """Fixed-width per choice (`-000`): SGLang aborts by rid prefix."""
    return_logprob: bool = True
    top_logprobs_num: int = 0
    """How many top alternatives per output token (0: none; they cost a top-k)."""
    lora_path: str | None = None
    """The served LoRA adapter to generate under, by name (when `lora_set`)."""
    lora_set: bool = False
    """Whether `lora_path` was chosen: then None means the base model; otherwise the
    server's default adapter (or none) serves the request."""
    engine_fields: Mapping[str, Any] = field(default_factory=dict)
    """Top-level fields sent as given in an SGLang-protocol body (the echo backend's
    test hooks); other engines ignore them."""

    @classmethod
    def for_tokens(
        cls,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any],
        *,
        rid: str,
        return_logprob: bool = True,
        top_logprobs_num: int = 0,
        lora_path: str | None = _UNSET,
        **engine_fields: Any,
    ) -> TokenRequest:
        """A request for `input_ids`. Raises pydantic's ValidationError (a ValueError)
        for sampling values SGLang rejects with 400, with SGLang's message.
        `lora_path`: the adapter to run under (None: the base model); left out: the
        server's default."""
        if not isinstance(sampling_params, SamplingParams):
            sampling_params = SamplingParams.model_validate(sampling_params)
        return cls(
            input_ids=list(input_ids),
            sampling_params=sampling_params,
            rid=rid,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            lora_path=None if lora_path is _UNSET else lora_path,
            lora_set=lora_path is not _UNSET,
            engine_fields=engine_fields,
        )

    @property
    def prompt_ids(self) -> Sequence[int]:
        return self.input_ids

    def on_adapter(self, served: str | None) -> TokenRequest:
        """This request run under the served adapter name `served` (None: the base)."""
        return dataclasses.replace(self, lora_path=served, lora_set=True)


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
