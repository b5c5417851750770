"""Wire models of the local engine: SGLang's native HTTP request and response shapes.

Field names and defaults follow SGLang (`GenerateReqInput`, `SamplingParams`, the
`meta_info` of `/generate`, the control endpoints); see
shared/reference/sglang-http-api.md sections 2, 4, 5 and 6. Torch-free; imported by
the scheduler (finish reasons) and the server (everything).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

# Temperatures below this mean greedy decoding (SGLang's convention).
GREEDY_EPS = 1e-6


class _Lenient(BaseModel):
    """Request bodies: unknown keys are ignored, as SGLang's dataclass bodies mostly do."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


class SamplingParams(_Lenient):
    """`sampling_params` of `/generate`. Validation messages follow SGLang's."""

    max_new_tokens: int | None = 128
    """None: up to the context length."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    """Also disables `stop_token_ids` (SGLang checks both only without ignore_eos)."""
    sampling_seed: int | None = Field(
        None, ge=-(2**63), le=2**64 - 1,  # what torch.Generator.manual_seed accepts
        validation_alias=AliasChoices("sampling_seed", "seed"))
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    n: int = 1

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if self.n != 1:
            raise ValueError("n > 1 is not supported by the local engine; send n separate requests.")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return tuple(s for s in stops if s)


class GenerateRequest(_Lenient):
    """Body of `POST /generate`. Batched `text`/`input_ids` are rejected (send one per prompt)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0)
    return_text_in_logprobs: bool = False
    stream: bool = False


class PauseRequest(_Lenient):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortRequest(_Lenient):
    rid: str = ""
    """Prefix match, as SGLang's scheduler does: `"a1"` also aborts `"a12"`."""
    abort_all: bool = False


class UpdateWeightsFromDiskRequest(_Lenient):
    model_path: str
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


# ---- responses -----------------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class FinishStop(_Out):
    type: Literal["stop"] = "stop"
    matched: int | str


class FinishLength(_Out):
    type: Literal["length"] = "length"
    length: int


class FinishAbort(_Out):
    type: Literal["abort"] = "abort"
    message: str = "Aborted"
    status_code: int | None = None
    err_type: str | None = None


FinishReason = FinishStop | FinishLength | FinishAbort

# [logprob, token_id, token_text_or_null], SGLang's triple.
LogprobTriple = tuple[float, int, str | None]


_OPTIONAL_META = ("output_token_logprobs", "output_top_logprobs", "e2e_latency")


class MetaInfo(_Out):
    """`meta_info` of a `/generate` response or stream chunk. The optional fields are left
    out when None, as in SGLang (logprobs only when asked, latency only when final);
    `finish_reason` is always present (null until the last chunk)."""

    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: str
    output_token_logprobs: list[LogprobTriple] | None = None
    output_top_logprobs: list[list[LogprobTriple] | None] | None = None
    e2e_latency: float | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in _OPTIONAL_META:
            if data.get(key) is None:
                data.pop(key, None)
        return data


class GenerateResponse(_Out):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class StatusMessage(_Out):
    message: str
    status: str = "ok"


class UpdateWeightsResponse(_Out):
    success: bool
    message: str
    num_paused_requests: int = 0


class ModelInfo(_Out):
    model_path: str
    tokenizer_path: str
    is_generation: bool = True
    preferred_sampling_params: None = None
    weight_version: str
    model_type: str
    architectures: list[str]


class InternalState(_Out):
    """Scheduler counters; `forward_calls` shows batching (one forward serves many rows)."""

    running: int
    waiting: int
    paused: bool
    pause_mode: str | None
    update_pending: bool
    forward_calls: int
    prefill_forward_calls: int
    decode_steps: int
    generated_tokens: int
    last_gen_throughput: float


class ServerInfo(_Out):
    served_model_name: str
    model_path: str
    tokenizer_path: str
    weight_version: str
    context_length: int
    max_running_requests: int
    device: str
    dtype: str
    version: str
    tp_size: int = 1
    dp_size: int = 1
    internal_states: list[InternalState]


class ModelCard(_Out):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "sglang"
    root: str
    parent: None = None
    max_model_len: int


class ModelList(_Out):
    object: str = "list"
    data: list[ModelCard]
