"""SGLang's native HTTP protocol, typed once: the endpoints, the `/generate` request and
reply (also each SSE stream chunk), the finish reasons, the control bodies and the info
replies. The gateway's clients (`gateway/backends/`) build requests and parses replies
with these models, the local engine (`engine/server.py`) validates and answers with
them, and the echo backend (`engine/echo_backend.py`) answers with them. Pure data: no
I/O, no torch, no FastAPI; imports nothing from `engine`, `gateway` or `trainer`.

What the gateway relies on, and nothing more (`ENDPOINTS` below is the same list in code):

- `POST /generate`, token in: `input_ids` (one prompt), `rid` (fixed width: SGLang aborts
  by rid PREFIX), `return_logprob`, `top_logprobs_num`, `stream`, and `sampling_params`
  keys `max_new_tokens`, `min_new_tokens` (reduced on resubmission), `temperature`,
  `top_p`, `top_k`, `stop`, `sampling_seed`, `frequency_penalty`, `presence_penalty`.
  Reply / stream chunk: `output_ids` (including the final EOS or stop token), and
  `meta_info.{id, finish_reason, prompt_tokens, completion_tokens, cached_tokens,
  weight_version, output_token_logprobs[i][0], output_top_logprobs[i][j][0:2],
  e2e_latency}`. `finish_reason` is null until the last chunk, then `{"type": "stop",
  "matched": id|str}`, `{"type": "length", "length": n}` or `{"type": "abort", ...}`
  (a pause in mode abort; a non-null `status_code` means a system error, not a pause).
  Streams are SSE `data: <json>` lines ending `data: [DONE]`, chunks CUMULATIVE by
  default (`--incremental-streaming-output` makes them deltas: the client tells them
  apart by `len(output_ids) == completion_tokens`); an error mid-stream is a
  `data: {"error": {...}}` line. `weight_version` is read when each output is emitted.
- `POST /pause_generation {"mode": "abort"}`, `POST /continue_generation {}`,
  `POST /update_weights_from_disk {model_path, weight_version, flush_cache}` ->
  `{success, message, num_paused_requests}` (400 with the same shape on failure),
  `POST /abort_request {rid, abort_all}`, `POST /flush_cache` (400 while busy).
- Distributed weight sync (`trainer.weight_sync: distributed`):
  `POST /init_weights_update_group {master_address, master_port, rank_offset,
  world_size, group_name, backend}` (every member's rendezvous keys under
  `weight_group_store_prefixes`), `POST /begin_weight_update {}`, `POST
  /update_weights_from_distributed {names, dtypes, shapes, group_name, weight_version,
  flush_cache}` (the trainer broadcasts the tensors, one broadcast per name in order
  from group rank 0, WHILE the call is in flight), `POST /end_weight_update {}` and
  `POST /destroy_weights_update_group {group_name}`, each -> `{success, message}`
  (begin and end are 404 on SGLang before the weight-update session existed: then
  nothing to open); `server_info.{tp_size, dp_size, pp_size, enable_dp_attention}` give a
  server's ranks in the group (`weight_group_ranks`).
- `GET /health` (200, or 503 while starting/unhealthy), `GET /model_info {model_path,
  weight_version, is_generation}` and `GET /server_info` (read only for display), each
  falling back to the older `/get_model_info` and `/get_server_info` on 404.
- Errors of native endpoints: `{"error": {"message": ...}}` with status 400 (503 when
  overloaded or unhealthy); duplicate in-flight rid -> 400.
- LoRA (`--enable-lora`, `--max-lora-rank`, `--lora-target-modules`; checked by reading
  `http_server.py` and `io_struct.py`, not run): `POST /load_lora_adapter {lora_name,
  lora_path, pinned}` and `POST /unload_lora_adapter {lora_name}`, each -> `{success,
  error_message, loaded_adapters}` (400 with the same shape on failure); `/generate`
  with `lora_path: <lora_name>` runs under that adapter (null: the base model). SGLang
  counts the requests running under an adapter and unloads it only after they end.
  Not in `ENDPOINTS` (the local engine loads adapters through its own
  `update_weights_from_disk` extension, `lora_name`).
- Data parallelism (`--dp-size`): a server joins a weight-update group with `tp_size`
  ranks, `rank_offset + tp_rank` each (`model_runner.init_weights_update_group`, which
  ignores dp and pp ranks); its tokenizer manager refuses the group unless `dp_size == 1`
  or `enable_dp_attention` (then the dp replicas live inside the `tp_size` ranks).
  `weight_group_ranks` below is that rule; a dp > 1 server without dp attention (or any
  pp > 1 server, whose stages would take the same ranks) is swapped from disk only.
  With dp > 1 the `/update_weights_from_disk` reply's `success`/`num_paused_requests`
  are per-replica lists (`UpdateWeightsResponse` folds them).

SGLang's router (`sglang-router`, the "SGLang Model Gateway"; `gateway.router.url`):
generation goes through it, every weight-control call goes to each worker it lists.
Run against sglang-router 0.3.2 (the PyPI wheel, `python -m sglang_router.launch_router`
in front of two local engines, `tests/integration/test_sglang_router.py`) and read in
`sgl-model-gateway/src/server.rs` of SGLang main:

- `GET /workers` -> `{"workers": [{"id", "url", "model_id", "worker_type", "is_healthy",
  "load", "metadata": {"tp_size", "dp_size", ...}, ...}], "total", "stats"}` (0.2.x and
  later; `POST /workers {"url"}` -> 202 adds one, queued and idempotent,
  `DELETE /workers/{id}` removes it). Older sgl-router (before Oct 2025):
  `GET /list_workers` -> `{"urls": [...]}` and `POST /add_worker?url=`, tried on 404. With
  `--dp-aware` a url carries `@<dp_rank>`; the server is the url without it.
- `GET /readiness` -> 200 `{"status": "ready", "healthy_workers", "total_workers"}`, 503
  without a healthy worker. `/health` and `/liveness` answer 200 whenever the router
  runs (tried only when `/readiness` is 404).
- Forwarded to one worker: `POST /generate` (SSE streams passed through unchanged),
  `/v1/*` inference routes, `/health_generate`, `/get_model_info`; header
  `X-SMG-Routing-Key` pins a session to one worker under `--policy manual` (0.3.x) or
  `consistent_hashing` (later), ignored by the other policies. `/get_server_info`
  answers about the router, not a worker.
- Fanned out by the router itself: only `POST /flush_cache` and `GET /get_loads`.
- Not routed (404): `/pause_generation`, `/continue_generation`, every
  `/update_weights_*` and weight-group endpoint, `/abort_request`, `/server_info` and
  `/model_info` (0.3.2). So pause -> update -> continue go to each worker, and so does an
  abort (a rid exists on one worker; the others ignore it).

Checked against the reference notes for SGLang 0.5.x: notes read from SGLang's source at
upstream main just after about v0.5.15 (that release number is inferred, not verified),
with the older names of about v0.5.3-0.5.6 as fallbacks. Run against a real SGLang
0.5.23 server on a CPU (`tests/integration/test_sglang_engine.py`: generation, streams,
pause / update from disk / continue, the gloo weight-update group, a server killed
mid-stream), which differs from the reading above in:

- the weight-update group's rendezvous (fixed): SGLang builds the group with torch's
  `_new_process_group_helper` on `PrefixStore(group_name, tcp_store)`, so its keys lie
  under `<name>`, `<name>/` and the backend's first device (`cpu/` for gloo), where the
  trainer's rank 0 and the local engine used one bare `ProcessGroupGloo` on
  `PrefixStore(name)`: they never met, and the gateway swapped from disk after the
  trainer's timeout. Every member now builds its group on
  `weight_group_store_prefixes` (rank 0 joins in ~0.6 s);
- `/update_weights_from_distributed` is refused (400, "must run between
  begin_weight_update() and end_weight_update()") unless `POST /begin_weight_update {}`
  came first; `POST /end_weight_update {}` closes the session, and a second begin
  before it is refused ("already open"). Fixed: the gateway opens the session before
  the first bucket and closes it after the last (also after a failure); the local
  engine enforces the same rule;
- (read in torch's `_new_process_group_helper`, not met in a run) a group name a
  server's process registered once cannot be joined again ("The specified group name
  has already been created"), also after the trainer or the gateway restarted: the
  trainer's group names carry a random suffix;
- a `sampling_params` its request parser rejects is answered 400 with a bare string,
  `{"error": "unknown field ..."}` (`ErrorResponse` reads both shapes);
- `sampling_seed` is accepted but honoured only by a server started with
  `--enable-deterministic-inference` (otherwise two requests with the same seed differ);
- `/model_info` reports the live `weight_version`, `/server_info` the launch-time one.

Speed: the gateway parses every streamed chunk with `GenerateResponse.model_validate_json`
straight from the bytes (pydantic-core's parser), which measured faster than the
`json.loads` plus hand-written dataclass constructor it replaced (3.1 vs 6.3 us for a
1-token chunk, 8.8 vs 13.0 us for 32 tokens with logprobs, on the 2-core dev box).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_serializer,
    model_serializer,
    model_validator,
)

GREEDY_EPS = 1e-6
"""Temperatures below this mean greedy decoding (SGLang's convention)."""

PauseMode = Literal["abort", "retract", "in_place"]
TopLogprobs = tuple[tuple[int, float], ...]
"""The (token_id, logprob) alternatives at one output position."""
LOGPROB_FLOOR = -1e4
"""Recorded for a sampled token without a finite logprob (see `output_logprobs`): far
below any real one (a 256k vocabulary's uniform logprob is -12.5), finite in float32."""

LogprobTriple = tuple[float | None, int, str | None]
"""SGLang's `[logprob, token_id, token_text_or_null]` (the text only with
`return_text_in_logprobs`)."""


# ---- endpoints ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One SGLang endpoint the gateway calls (and the local engine serves)."""

    method: str
    path: str
    legacy_path: str | None = None
    """Older SGLang name, tried on 404."""


GENERATE = Endpoint("POST", "/generate")
PAUSE_GENERATION = Endpoint("POST", "/pause_generation")
CONTINUE_GENERATION = Endpoint("POST", "/continue_generation")
UPDATE_WEIGHTS_FROM_DISK = Endpoint("POST", "/update_weights_from_disk")
ABORT_REQUEST = Endpoint("POST", "/abort_request")
FLUSH_CACHE = Endpoint("POST", "/flush_cache")
HEALTH = Endpoint("GET", "/health")
MODEL_INFO = Endpoint("GET", "/model_info", legacy_path="/get_model_info")
SERVER_INFO = Endpoint("GET", "/server_info", legacy_path="/get_server_info")
INIT_WEIGHTS_UPDATE_GROUP = Endpoint("POST", "/init_weights_update_group")
UPDATE_WEIGHTS_FROM_DISTRIBUTED = Endpoint("POST", "/update_weights_from_distributed")
DESTROY_WEIGHTS_UPDATE_GROUP = Endpoint("POST", "/destroy_weights_update_group")
BEGIN_WEIGHT_UPDATE = Endpoint("POST", "/begin_weight_update")
END_WEIGHT_UPDATE = Endpoint("POST", "/end_weight_update")
LOAD_LORA_ADAPTER = Endpoint("POST", "/load_lora_adapter")
UNLOAD_LORA_ADAPTER = Endpoint("POST", "/unload_lora_adapter")

ENDPOINTS: tuple[Endpoint, ...] = (
    GENERATE,
    PAUSE_GENERATION,
    CONTINUE_GENERATION,
    UPDATE_WEIGHTS_FROM_DISK,
    ABORT_REQUEST,
    FLUSH_CACHE,
    HEALTH,
    MODEL_INFO,
    SERVER_INFO,
    INIT_WEIGHTS_UPDATE_GROUP,
    UPDATE_WEIGHTS_FROM_DISTRIBUTED,
    DESTROY_WEIGHTS_UPDATE_GROUP,
    BEGIN_WEIGHT_UPDATE,
    END_WEIGHT_UPDATE,
)
"""Every SGLang endpoint the gateway relies on (see the module docstring for fields)."""

SGLANG_VERSIONS_CHECKED = (
    "0.5.x, by reading source (main after ~v0.5.15; legacy names ~v0.5.3-0.5.6); "
    "0.5.23 run on a CPU"
)
"""What the list above was checked against: reading SGLang's source, and running 0.5.23."""

# ---- SGLang's router (sglang-router / sgl-model-gateway) ------------------------------

ROUTER_WORKERS = Endpoint("GET", "/workers", legacy_path="/list_workers")
ROUTER_ADD_WORKER = Endpoint("POST", "/workers", legacy_path="/add_worker")
"""Body `{"url"}` -> 202 `{"status": "accepted", "worker_id", ...}`, queued, idempotent
for a known url; the legacy name takes `?url=` and answers 200."""
ROUTER_READINESS = Endpoint("GET", "/readiness", legacy_path="/health")
ROUTER_ENDPOINTS: tuple[Endpoint, ...] = (
    ROUTER_WORKERS,
    ROUTER_ADD_WORKER,
    ROUTER_READINESS,
    GENERATE,
)
"""The router endpoints this project calls (the gateway lists, the launcher adds the
servers it launched); everything else goes to each worker."""
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
"""Session affinity through the router (`--policy manual`): same key, same worker."""
SGLANG_ROUTER_VERSION_CHECKED = (
    "sglang-router 0.3.2 (run against the local engine); "
    "sgl-model-gateway main (read); /list_workers of older "
    "sgl-router (read)"
)


def router_worker_urls(listing: Mapping[str, Any]) -> list[str]:
    """The worker base URLs of a `/workers` (or legacy `/list_workers`) reply, in order,
    each once: `--dp-aware` entries `url@rank` are one server."""
    entries = listing.get("workers")
    if isinstance(entries, list):
        urls = [str(w.get("url", "")) if isinstance(w, Mapping) else str(w) for w in entries]
    else:
        urls = [str(u) for u in listing.get("urls") or ()]
    seen: dict[str, None] = {}
    for url in urls:
        base, at, rank = url.rpartition("@")
        seen.setdefault((base if at and rank.isdigit() else url).rstrip("/"), None)
    return [u for u in seen if u]


def weight_group_ranks(server_info: Mapping[str, Any]) -> int:
    """Ranks one server takes in a weight-update group (SGLang's rule, see the module
    docstring): `tp_size`. ValueError where SGLang cannot join: `dp_size > 1` without
    `enable_dp_attention` (its tokenizer manager refuses), or `pp_size > 1` (every stage
    would take the same `rank_offset + tp_rank`)."""
    tp = int(server_info.get("tp_size") or 1)
    dp = int(server_info.get("dp_size") or 1)
    pp = int(server_info.get("pp_size") or 1)
    if dp > 1 and not server_info.get("enable_dp_attention"):
        raise ValueError(
            f"a server with dp_size={dp} (no dp attention) cannot join a "
            "weight-update group; SGLang allows it only with dp_size 1 or "
            "--enable-dp-attention (swapped from disk instead)"
        )
    if pp > 1:
        raise ValueError(
            f"a server with pp_size={pp} cannot join a weight-update group "
            "(its pipeline stages would take the same ranks)"
        )
    return tp


def weight_group_layout(server_infos: Sequence[Mapping[str, Any]]) -> tuple[int, list[int]]:
    """(world size, rank offset of each server) of a group with the trainer as rank 0 and
    the servers after it in order. ValueError as `weight_group_ranks`."""
    ranks = [weight_group_ranks(info) for info in server_infos]
    offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
    return 1 + sum(ranks), offsets


def weight_group_store_prefixes(group_name: str, backend: str) -> tuple[str, ...]:
    """The `PrefixStore` prefixes, outermost first, under which every member of a
    weight-update group keeps its rendezvous keys on rank 0's TCPStore. SGLang builds its
    side with `init_custom_process_group` (`sglang/srt/utils/common.py`):
    `PrefixStore(group_name, tcp_store)`, then torch's `_new_process_group_helper`, which
    adds `<group_name>/` and the first device of the backend (`cpu/` for gloo, which
    declares cpu and cuda but builds one backend for both; `cuda/` for nccl). A member on
    any other layout never meets it: the rendezvous waits out its timeout."""
    device = "cuda" if backend == "nccl" else "cpu"
    return (group_name, f"{group_name}/", f"{device}/")


def parse_version(weight_version: str | None) -> int:
    """`meta_info.weight_version` as an int policy version; non-numeric ("default") -> 0."""
    text = (weight_version or "").strip()
    return int(text) if text.isdigit() else 0


# ---- requests ----------------------------------------------------------------------


class _Body(BaseModel):
    """Request bodies. Unknown keys are kept (a client may send SGLang options this
    model does not name, and they must reach SGLang); the local engine ignores them."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)


class SamplingParams(_Body):
    """`sampling_params` of `/generate`, with SGLang's defaults and validation messages."""

    max_new_tokens: int | None = 128
    """None: up to the context length."""
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    """{token id as a string: bias added to its logit before sampling}."""
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    """Also disables `stop_token_ids` (SGLang checks both only without ignore_eos)."""
    sampling_seed: int | None = Field(
        None,
        ge=-(2**63),
        le=2**64 - 1,  # what torch.Generator.manual_seed accepts
        validation_alias=AliasChoices("sampling_seed", "seed"),
    )
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
        for token in self.logit_bias or {}:
            if not token.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {token!r}.")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return tuple(s for s in stops if s)


class GenerateRequest(_Body):
    """Body of `POST /generate` (SGLang's `GenerateReqInput`, the fields named here).

    Sent with `exclude_unset`: only what the sender set goes on the wire, so SGLang's
    own defaults (and its `--preferred-sampling-params`) apply to the rest."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0)
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | None = None
    """The served LoRA adapter to generate under, by name (SGLang's field; the local
    engine's adapters are named by policy). Unset: the default adapter, or none."""

    @property
    def prompt_ids(self) -> list[int]:
        """`input_ids` of a single-prompt request."""
        ids = self.input_ids or []
        assert not ids or isinstance(ids[0], int), "batched input_ids"
        return ids


class PauseRequest(_Body):
    mode: PauseMode = "abort"


class ContinueGenerationRequest(_Body):
    """`{}` is what the gateway sends; SGLang also reads `torch_empty_cache`."""

    torch_empty_cache: bool = False


class AbortRequest(_Body):
    rid: str = ""
    """Prefix match, as SGLang's scheduler does: `"a1"` also aborts `"a12"`."""
    abort_all: bool = False


class UpdateWeightsFromDiskRequest(_Body):
    model_path: str
    weight_version: str | None = None
    lora_name: str | None = None
    """The local engine's extension for named policies: load the adapter directory at
    `model_path` under this name, and version only its tokens with `weight_version`
    (the default adapter and its version are untouched; the name `default` swaps the
    default policy's adapter and version), without pausing the other policies' rows."""
    flush_cache: bool = True
    abort_all_requests: bool = False


class InitWeightsUpdateGroupRequest(_Body):
    """Join the trainer's weight-update group as ranks rank_offset..+tp_size-1. The call
    returns once every rank of `world_size` has joined (the trainer is rank 0)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedRequest(_Body):
    """One bucket: receive `names[i]` (dtype name as in `torch.<dtype>`, shape) from group
    rank 0, one broadcast per name in order, and load them."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class DestroyWeightsUpdateGroupRequest(_Body):
    group_name: str = "weight_update_group"


class WeightUpdateSessionRequest(_Body):
    """`{}`: the body of `/begin_weight_update` and `/end_weight_update` (SGLang's begin
    also reads `selector`, default "all": the target model and any draft model)."""


class LoadLoRAAdapterRequest(_Body):
    """Body of SGLang's `POST /load_lora_adapter`: serve the PEFT adapter directory
    `lora_path` under `lora_name` (a new name; SGLang refuses one already loaded)."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    """Pinned adapters are never evicted from the GPU pool (not used: versions rotate)."""


class UnloadLoRAAdapterRequest(_Body):
    """Body of SGLang's `POST /unload_lora_adapter`."""

    lora_name: str


# ---- replies -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FinishReason:
    """`meta_info.finish_reason`: stop (`matched`: token id or stop string), length
    (`length`) or abort (`message`; `status_code` set on system aborts, i.e. errors,
    which must not be resubmitted). The one finish-reason type of the gateway and the
    engine (`gateway/translate.py::finish_reason_for` maps it to OpenAI's)."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None

    def to_json(self) -> dict[str, Any]:
        """SGLang's shape: only the keys of this type."""
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {
            "type": "abort",
            "message": self.message,
            "status_code": self.status_code,
            "err_type": self.err_type,
        }


_OPTIONAL_META = (
    "output_token_logprobs",
    "output_top_logprobs",
    "input_token_logprobs",
    "e2e_latency",
)


class MetaInfo(BaseModel):
    """`meta_info` of a `/generate` reply or stream chunk. The optional fields are left
    out when None, as in SGLang (logprobs only when asked, latency only when final);
    `finish_reason` is always present (null until the last chunk). Defaults cover what
    SGLang omits (an abort of a still-queued request carries only `completion_tokens`);
    other keys SGLang adds are ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str = "default"
    output_token_logprobs: list[LogprobTriple] | None = None
    output_top_logprobs: list[list[LogprobTriple] | None] | None = None
    input_token_logprobs: list[LogprobTriple] | None = None
    """Prompt logprobs from `logprob_start_len` (the swap canary's scoring request)."""
    e2e_latency: float | None = None

    @field_serializer("finish_reason")
    def _finish_json(self, finish: FinishReason | None) -> dict[str, Any] | None:
        return None if finish is None else finish.to_json()

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in _OPTIONAL_META:
            if data.get(key) is None:
                data.pop(key, None)
        return data


class GenerateResponse(BaseModel):
    """One `/generate` reply, or one stream chunk (cumulative unless the server runs
    `--incremental-streaming-output`)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    text: str = ""
    output_ids: list[int]
    meta_info: MetaInfo

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.meta_info.finish_reason

    @property
    def cumulative(self) -> bool:
        """Whether `output_ids` holds the whole output so far (SGLang's default)."""
        return len(self.output_ids) == self.meta_info.completion_tokens

    def output_logprobs(self, start: int = 0) -> tuple[float, ...]:
        """The logprob of each output token from `start` (empty unless `return_logprob`).
        A token SGLang gives no finite logprob (it writes -inf as JSON null; a logit bias
        or penalty can push a sampled token there) is recorded at `LOGPROB_FLOOR`, so the
        store, the replies' JSON and the trainer's ratios stay finite."""
        lps = self.meta_info.output_token_logprobs or ()
        out = [t[0] for t in (lps[start:] if start else lps)]
        if not all(lp is not None and lp >= LOGPROB_FLOOR for lp in out):  # NaN too
            out = [LOGPROB_FLOOR if lp is None or not lp >= LOGPROB_FLOOR else lp for lp in out]
        return tuple(out)  # type: ignore[arg-type]

    def output_top_logprobs(self) -> tuple[TopLogprobs, ...]:
        """Per position, the (token_id, logprob) alternatives (`top_logprobs_num` > 0)."""
        tops = self.meta_info.output_top_logprobs
        if not tops:  # the usual chunk: no alternatives asked for
            return ()
        return tuple(
            tuple((t[1], t[0]) for t in pos or ())  # type: ignore[misc]
            for pos in tops
        )

    @property
    def weight_version(self) -> str:
        return self.meta_info.weight_version

    def with_version(self, version: str) -> GenerateResponse:
        """This reply labelled `version` (the reply itself is not changed)."""
        meta = self.meta_info.model_copy(update={"weight_version": version})
        return self.model_copy(update={"meta_info": meta})


class ErrorDetail(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")

    message: str
    type: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    """SGLang's native error envelope, also the mid-stream `data: {"error": ...}` event.
    SGLang 0.5.23 (run) answers a `sampling_params` its request parser rejects with a
    bare string, `{"error": "unknown field `x`, expected one of ..."}`: read as its
    message."""

    model_config = ConfigDict(frozen=True, extra="allow")

    error: ErrorDetail

    @model_validator(mode="before")
    @classmethod
    def _bare_string_error(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("error"), str):
            return {**data, "error": {"message": data["error"]}}
        return data


class _Reply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")


class StatusMessage(_Reply):
    """Reply of `/pause_generation` and `/continue_generation`."""

    message: str
    status: str = "ok"


class UpdateWeightsResponse(_Reply):
    """`{success, message, num_paused_requests}`; a dp > 1 server answers a disk update
    with per-replica lists, folded here (success: all of them)."""

    success: bool
    message: str
    num_paused_requests: int = 0

    @model_validator(mode="before")
    @classmethod
    def _fold_replicas(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if isinstance(data.get("success"), list):
                data = {**data, "success": all(data["success"])}
            if isinstance(data.get("message"), list):
                data = {**data, "message": " | ".join(map(str, data["message"]))}
            if isinstance(data.get("num_paused_requests"), list):
                data = {**data, "num_paused_requests": sum(data["num_paused_requests"])}
        return data


class LoRAUpdateResponse(_Reply):
    """SGLang's answer to a LoRA load or unload (`LoRAUpdateOutput`)."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, Any] | None = None


class ModelInfo(_Reply):
    """`/model_info`; the other keys SGLang sends stay in `model_extra`."""

    model_path: str = ""
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: dict[str, Any] | None = None
    weight_version: str = "default"
    model_type: str | None = None
    architectures: list[str] | None = None
    adapter_versions: dict[str, str] = Field(default_factory=dict)
    """The local engine's extension for named policies: each named adapter's version
    (SGLang sends none); the gateway re-syncs a returning backend to every policy's."""


class ServerInfo(_Reply):
    """`/server_info`: every ServerArgs field plus scheduler state; the shape varies by
    version, so the gateway only displays it. The fields the local engine fills."""

    served_model_name: str
    weight_version: str = "default"
    version: str = ""
    model_path: str | None = None
    tokenizer_path: str | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    device: str | None = None
    dtype: str | None = None
    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    internal_states: list[dict[str, Any]] = Field(default_factory=list)


class ModelCard(_Reply):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "sglang"
    root: str
    parent: None = None
    max_model_len: int


class ModelList(_Reply):
    object: str = "list"
    data: list[ModelCard]
