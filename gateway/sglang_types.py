"""Typed records of SGLang's native HTTP API as the gateway uses it: the `/generate`
request, its result or stream chunk, a finished (possibly resubmitted) generation and
its stream deltas, the errors, and swap timings. Pure data: no I/O here
(`gateway/backend.py` is the client that produces them).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

PauseMode = Literal["abort", "retract", "in_place"]
TopLogprobs = tuple[tuple[int, float], ...]
"""The (token_id, logprob) alternatives at one output position."""
class BackendError(Exception):
    """The backend answered with an error status (or a mid-stream error event)."""

    def __init__(self, status: int, message: str, *, url: str = "") -> None:
        super().__init__(f"{url or 'backend'}: {status} {message}")
        self.status = status
        self.message = message
        self.url = url


class BackendUnavailable(BackendError):
    """Unreachable, reset, timed out, 503 or stuck paused: routes answer 503 + retry-after.

    `sent` is False only when the request certainly never reached the backend
    (connection refused / connect timeout), so it is safe to retry elsewhere."""

    def __init__(self, message: str, *, url: str = "", sent: bool = True) -> None:
        super().__init__(503, message, url=url)
        self.sent = sent


def parse_version(weight_version: str | None) -> int:
    """`meta_info.weight_version` as an int policy version; non-numeric ("default") → 0."""
    text = (weight_version or "").strip()
    return int(text) if text.isdigit() else 0


@dataclass(frozen=True, slots=True)
class FinishReason:
    """SGLang's `meta_info.finish_reason`: stop (matched), length (length) or abort."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    """Set on system aborts (errors), which must not be resubmitted."""

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> FinishReason:
        return cls(type=str(obj.get("type")), matched=obj.get("matched"),
                   length=obj.get("length"), message=obj.get("message"),
                   status_code=obj.get("status_code"))


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """Body of `POST /generate` (token in: no `text`)."""

    input_ids: tuple[int, ...]
    sampling_params: Mapping[str, Any] = field(default_factory=dict)
    """SGLang sampling params (max_new_tokens, temperature, top_p, top_k, stop_token_ids…)."""
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Fixed-length unique id: SGLang aborts by rid prefix."""
    return_logprob: bool = True
    stream: bool = False
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    """Other top-level `/generate` keys (priority, lora_path, …), sent as given."""

    def to_json(self) -> dict[str, Any]:
        return {**self.extra_body, "input_ids": list(self.input_ids),
                "sampling_params": dict(self.sampling_params), "rid": self.rid,
                "return_logprob": self.return_logprob, "stream": self.stream}


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """One `/generate` response or stream chunk, as the server sent it (stream chunks
    are cumulative unless the server runs `--incremental-streaming-output`)."""

    rid: str
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    finish_reason: FinishReason | None
    """None on intermediate stream chunks."""
    weight_version: str
    prompt_tokens: int
    completion_tokens: int
    e2e_latency: float | None
    text: str
    output_top_logprobs: tuple[TopLogprobs, ...] = ()
    """Per position, the (token_id, logprob) alternatives (when `top_logprobs_num` > 0)."""

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> GenerateResult:
        meta = obj.get("meta_info") or {}
        finish = meta.get("finish_reason")
        ids = tuple(obj.get("output_ids") or ())
        return cls(
            rid=str(meta.get("id") or ""), output_ids=ids,
            output_logprobs=tuple(t[0] for t in meta.get("output_token_logprobs") or ()),
            finish_reason=FinishReason.from_json(finish) if finish else None,
            weight_version=str(meta.get("weight_version", "default")),
            prompt_tokens=int(meta.get("prompt_tokens") or 0),
            completion_tokens=int(meta.get("completion_tokens") or len(ids)),
            e2e_latency=meta.get("e2e_latency"), text=str(obj.get("text") or ""),
            output_top_logprobs=tuple(tuple((int(t[1]), float(t[0])) for t in pos or ())
                                      for pos in meta.get("output_top_logprobs") or ()))


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
class ModelInfo:
    model_path: str
    weight_version: str
    is_generation: bool
    raw: Mapping[str, Any]
    """Everything `/model_info` returned (architectures, preferred_sampling_params…)."""


@dataclass(frozen=True, slots=True)
class SwapTimings:
    """Seconds spent in each phase of one backend's weight swap."""

    pause_s: float
    update_s: float
    continue_s: float
    total_s: float
