"""`gateway:`: what the gateway serves, and its sections (auth, limits, sessions,
continuity, sampling, router, scale). The previous release's flat keys are moved into
their sections (`config_renames.py`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from areal_service.admin_key import DEFAULT_ADMIN_KEY
from areal_service.config.section import Section
from areal_service.config_renames import move_flat_gateway_keys
from areal_service.cpu_share import host_cores

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


class AuthConfig(Section):
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


class LimitsConfig(Section):
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
    """Requests without an API key that send a body being served at once, in each of two
    pools: the console's (sign-in and its form posts) and the rest; beyond, 503 with
    retry-after. Health checks and page loads are not counted."""
    max_anonymous_per_address: int = Field(8, ge=1)
    """Of those, how many one client address may have in progress in each pool (the
    address the auth throttle counts): one address cannot fill a pool."""
    anonymous_body_timeout_s: float = Field(5.0, gt=0)
    """A request without an API key must send its whole body within this of its headers
    (its bodies are small: `anonymous_body_bytes`); after it, 408 and the connection is
    closed."""
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


class SessionsConfig(Section):
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


class ContinuityConfig(Section):
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


class SamplingConfig(Section):
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


class RouterConfig(Section):
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


class ScaleConfig(Section):
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


class GatewayConfig(Section):
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
        return max(1, min(host_cores() // 4, 8))

    def external_backends(self) -> bool:
        """Whether generation is served by backends given by URL (or a router) rather
        than the local engine a command starts beside the gateway."""
        return bool(self.router.backends or self.router.url)

    def shares_store(self) -> bool:
        """Whether other gateway processes write the same store: replicas, or a worker
        count (resolved by `gateway/server.py` before the app is built) above 1."""
        return self.scale.replicas or self.scale.workers > 1
