"""Frozen wire contracts passed between hops (gateway -> store -> trainer).

Token ids, logprobs and per-token versions travel as tuples here; the store packs them
into binary arrays (int32 / float32) on the way in and unpacks them on the way out.
Torch-free and SQLAlchemy-free: every component can import it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from areal_service.packing import unpack_int32

DEFAULT_POLICY = "default"
"""The policy of every key, session, version and step that names none: today's single
policy (served as `areal_service.lora_adapter.ADAPTER_NAME` when LoRA is on)."""

SessionStatus = Literal["open", "ended", "claimed", "trained", "dropped"]
KeyKind = Literal["user", "session"]


def now() -> float:
    """Wall-clock seconds since the epoch, the one timestamp unit of every record."""
    return time.time()


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    """A virtual API key. Only the SHA-256 of the plaintext is ever stored."""

    id: str
    key_hash: str
    """Hex SHA-256 of the plaintext key."""
    display: str
    """What the console shows, e.g. `sk-ar…7sFA` (prefix and last four characters)."""
    name: str = ""
    kind: KeyKind = "user"
    """`user`: a long-lived virtual key; `session`: scoped to `session_id` only."""
    session_id: str | None = None
    """The session a `session` key is bound to; a `user` key's current session."""
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=now)
    last_used_at: float | None = None
    revoked_at: float | None = None
    rpm_limit: int | None = None
    """Requests per minute (None: unlimited); the gateway answers 429 past it."""
    tpm_limit: int | None = None
    """Prompt + completion tokens per minute (None: unlimited)."""
    max_concurrent: int | None = None
    """Requests in flight at once (None: unlimited)."""
    token_budget: int | None = None
    """Total prompt + completion tokens this key may ever use (None: unlimited)."""
    tokens_used: int = 0
    """Tokens used so far (written by the gateway's periodic flush, like `last_used_at`)."""
    policy: str = DEFAULT_POLICY
    """The policy (`policies:`) the key's sessions are served and trained by; set at
    creation."""


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """An episode: the completions of one agent run that earns one return."""

    id: str
    group_id: str | None = None
    """GRPO group: the sessions that answer the same task."""
    task_id: str | None = None
    status: SessionStatus = "open"
    api_key_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=now)
    last_activity_at: float = field(default_factory=now)
    ended_at: float | None = None
    end_reason: str | None = None
    """Why it ended: `client`, `reward`, `idle_timeout`, `refresh`, `no_reward` (the
    client declared that no reward will come: see `END_NO_REWARD`), ..."""
    policy: str = DEFAULT_POLICY
    """The policy that serves the session and trains on it (its key's, unless the admin
    named one)."""
    parent_session_id: str | None = None
    """Set on a role sub-session: the multi-agent episode's own session. Its completions
    were served under another policy than the episode's (a role's model name), and its
    policy (the role) trains on them (`gateway/roles.py`)."""
    drop_reason: str | None = None
    """Why a `dropped` session trains nothing (`stale: ...`, `unrewarded: ...`, `group
    incomplete: ...`, `failed: ...`, a missing part); set by the trainer's claim."""


def role_session_id(episode_id: str, policy: str) -> str:
    """The id of the role sub-session of episode `episode_id` under `policy`: derived, so
    every gateway process finds it without a store query, and unlike any session id the
    gateway makes otherwise (those have no `~`)."""
    return f"{episode_id}~{policy}"


END_NO_REWARD = "no_reward"
"""End reason of a session whose client declared that no reward will come: the trainer
does not wait `trainer.reward_wait_s` for one (`trainer.unrewarded_policy` applies)."""

END_FAILED = "failed"
"""End reason of a session whose agent failed (it raised, or gave up): the trainer drops
it alone (drop reason `failed: ...`) and its group trains on the rest."""


@dataclass(frozen=True, slots=True)
class CompletionRecord:
    """One model call exactly as served: the token ids in and out, with their logprobs
    and the policy version that produced each output token."""

    id: str
    """The id returned to the client (`chatcmpl-…` / `resp_…`) and in `x-request-id`."""
    model: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    """Behaviour logprobs: log softmax(logits / T) at each sampled token."""
    output_versions: tuple[int, ...]
    """Weight version that produced each output token (mixed when a swap happened)."""
    finish_reason: str
    """OpenAI finish reason sent to the client: stop | length | tool_calls | abort."""
    session_id: str | None = None
    api_key_id: str | None = None
    parent_id: str | None = None
    """Earlier completion in the session whose prompt+output ids prefix this prompt."""
    request_json: dict[str, Any] = field(default_factory=dict)
    response_json: dict[str, Any] = field(default_factory=dict)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    backend: str = ""
    latency_ms: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    created_at: float = field(default_factory=now)
    requested_model: str | None = None
    """The model name the client sent (served by the policy `model` whatever it was)."""
    continuity_key: str | None = None
    """What a later turn of the session needs to continue this completion's exact ids
    from the store (`gateway/continuity.py`); None without a session."""


@dataclass(frozen=True, slots=True)
class AuthFailures:
    """Failed sign-ins and unknown bearer tokens from one client address, as one gateway
    process counted them (or summed over several): what the auth throttle locks out on
    (`gateway/throttle.py`). Times are wall-clock seconds (`time.time()`)."""

    failures: int
    last_failure: float
    locked_until: float = 0.0


@dataclass(frozen=True, slots=True)
class KeyCounts:
    """A key's live counts in one gateway process (or summed over several): what the
    per-key limits check (`gateway/limits.py`)."""

    requests: int = 0
    """Requests admitted in the last minute."""
    tokens: int = 0
    """Tokens used in the last minute."""
    in_flight: int = 0
    unflushed_tokens: int = 0
    """Tokens counted but not yet in the stored `tokens_used`."""

    def __add__(self, other: KeyCounts) -> KeyCounts:
        return KeyCounts(
            self.requests + other.requests,
            self.tokens + other.tokens,
            self.in_flight + other.in_flight,
            self.unflushed_tokens + other.unflushed_tokens,
        )


@dataclass(frozen=True, slots=True)
class RecentTurn:
    """A session's recent completion as token continuity reads it back from the store:
    its key, and its ids still packed (int32 LE; unpacked only for the one that
    matches)."""

    completion_id: str
    continuity_key: str
    packed_prompt_ids: bytes
    packed_output_ids: bytes

    def prompt_ids(self) -> list[int]:
        return list(unpack_int32(self.packed_prompt_ids))

    def output_ids(self) -> list[int]:
        return list(unpack_int32(self.packed_output_ids))


@dataclass(frozen=True, slots=True)
class RewardRecord:
    """A named score on a completion, a session or a whole group. Idempotent by
    (`owner`, `id`): a client's ids are its own, another key cannot read or squat them."""

    id: str
    value: float
    name: str = "reward"
    completion_id: str | None = None
    session_id: str | None = None
    group_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=now)
    owner: str = ""
    """Who posted it: the id of the virtual or session key, "" for the admin key."""


@dataclass(frozen=True, slots=True)
class WeightVersionRecord:
    """A published policy version: HF safetensors at `path`, plus swap timings."""

    version: int
    path: str
    created_at: float = field(default_factory=now)
    metadata: dict[str, Any] = field(default_factory=dict)
    """Swap timings per backend and phase, filled in by the gateway's syncer."""
    policy: str = DEFAULT_POLICY
    """Whose version this is: versions count per policy."""


@dataclass(frozen=True, slots=True)
class PolicyRecord:
    """A policy created at runtime (`POST /admin/policies`, `areal-service policies
    create`, the console), kept in the store so every gateway process and trainer sees
    it. Config-declared policies are not stored: the config stays their source."""

    name: str
    lora: dict[str, Any] | None = None
    """The adapter's shape as `LoRAConfig` fields; None: `default_policy.lora`'s."""
    model_names: tuple[str, ...] = ()
    """Request model names that pick this policy (unique across all policies)."""
    created_at: float = field(default_factory=now)
    roles: tuple[str, ...] = ()
    """The policies its episodes may open as roles (`PolicyConfig.roles`)."""


@dataclass(frozen=True, slots=True)
class TrainStepRecord:
    """One optimizer step of the trainer and its metrics (plotted by the console)."""

    step: int
    version: int
    metrics: dict[str, float] = field(default_factory=dict)
    created_at: float = field(default_factory=now)
    policy: str = DEFAULT_POLICY
    """The policy this step trained: steps count per policy."""


@dataclass(frozen=True, slots=True)
class TrainSequence:
    """One training sequence: a chain of completions in a session whose prompt+output
    ids are exact prefixes of each other, merged without retokenization.

    All per-token tuples have the same length as `input_ids`. Generated tokens have
    loss_mask 1 with their behaviour logprob and version; everything else (prompt,
    tool results, user turns, template glue) has loss_mask 0, logprob 0.0, version -1.
    """

    session_id: str
    group_id: str | None
    completion_ids: tuple[str, ...]
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    reward: float
    """The return of the sequence's first completion (R_i = r_i + γ·R_{i+1})."""
    temperature: float = 1.0
    """Sampling temperature of the completions (the trainer scales logits by it)."""
    truncated: bool = False
    """The last completion it trains hit its token limit (`finish_reason: "length"`):
    what `trainer.no_eos` acts on. An output ended by a stop string (`"stop"`, no EOS
    token at its end) or a tool call is not truncated."""


@dataclass(frozen=True, slots=True)
class EpisodeGroup:
    """Finished, rewarded sessions of one GRPO group, claimed together for training."""

    group_id: str
    session_ids: tuple[str, ...]
    sequences: tuple[TrainSequence, ...]
    session_returns: tuple[float, ...]
    """One return per session (same order as session_ids): what GRPO normalizes."""
    staleness: int
    """current version − oldest token version in the group."""
    claim_id: str = ""
    """Token of the claim; `mark_trained` / `release_claim` take it."""
    grouped: bool = True
    """False for an ungrouped session (a group of one keyed by its session id): its
    advantage comes from `trainer.ungrouped_baseline`, not from a group."""
    task_id: str | None = None
    """The task of the group's first session (the key of a per-task running baseline)."""


@dataclass(frozen=True, slots=True)
class DroppedEpisodes:
    """Sessions a claim took out of the training pool without training them, and why."""

    group_id: str
    session_ids: tuple[str, ...]
    reason: str
    """`stale: ...`, `missing parent ...`, `no completions`, `unrewarded: ...`, `group ...`."""
    staleness: int
    """current version − oldest token version of these sessions (0 without tokens)."""


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """What one `claims.EpisodeClaimer.claim_groups` call did: the groups now held by
    the caller (train them, then `mark_trained(claim_id)`), and what it dropped."""

    groups: tuple[EpisodeGroup, ...]
    dropped: tuple[DroppedEpisodes, ...] = ()
