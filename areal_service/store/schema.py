"""SQLAlchemy 2 tables of the trajectory store (keys, sessions, completions, rewards,
weight versions, train steps): the physical layout only.

`rows.py` converts rows to the records of `types.py`; `migrations/versions/` must match
this file exactly (a test autogenerates against an upgraded database: no diff allowed).
Timestamps are float epoch seconds; token arrays are packed blobs (`packing.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Stable constraint names, so Alembic can address them in batch (SQLite) migrations.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    if TYPE_CHECKING:
        # DeclarativeBase types it FromClause (it may be any selectable); every class
        # here declares columns, so it is a Table (what insert/update/COPY take).
        __table__: ClassVar[Table]


# `metadata` is reserved on declarative classes: the JSON column keeps its SQL name
# `metadata` and is reached as the attribute `meta`.


class ApiKeyRow(Base):
    """A virtual key; the plaintext is never stored. `session_id` carries no foreign key:
    sessions reference keys, and a cycle would order every insert."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    key_hash: Mapped[str] = mapped_column(String, index=True, unique=True)
    display: Mapped[str] = mapped_column(String)
    name: Mapped[str] = mapped_column(String)
    kind: Mapped[str] = mapped_column(String(16))
    session_id: Mapped[str | None] = mapped_column(String)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)
    created_at: Mapped[float] = mapped_column(Float)
    last_used_at: Mapped[float | None] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float)
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    tpm_limit: Mapped[int | None] = mapped_column(Integer)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    token_budget: Mapped[int | None] = mapped_column(BigInteger)
    tokens_used: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    policy: Mapped[str] = mapped_column(String, default="default", server_default="default")


class SessionRow(Base):
    """An episode. `api_key_id` has no foreign key: the admin key has no row. The claim
    columns belong to `claims.py`: `claim_id` is set while a trainer holds the session
    (status `claimed`) and kept once it is `trained`; `drop_reason` says why a session
    was `dropped` (stale, missing part, no reward)."""

    __tablename__ = "sessions"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    group_id: Mapped[str | None] = mapped_column(String, index=True)
    task_id: Mapped[str | None] = mapped_column(String, index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    api_key_id: Mapped[str | None] = mapped_column(String)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)
    created_at: Mapped[float] = mapped_column(Float, index=True)
    last_activity_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    end_reason: Mapped[str | None] = mapped_column(String)
    claim_id: Mapped[str | None] = mapped_column(String, index=True)
    claimed_by: Mapped[str | None] = mapped_column(String)
    claimed_at: Mapped[float | None] = mapped_column(Float)
    trained_at: Mapped[float | None] = mapped_column(Float)
    drop_reason: Mapped[str | None] = mapped_column(String)
    policy: Mapped[str] = mapped_column(
        String, index=True, default="default", server_default="default"
    )
    """The policy that serves and trains the session; a policy's trainer claims only
    its own (`claims.py`)."""
    parent_session_id: Mapped[str | None] = mapped_column(String, index=True)
    """Set on a role sub-session of a multi-agent episode: the episode's own session,
    whose group, task and key it shares; its `policy` is the role. No foreign key: the
    two rows are written apart and a parent is never deleted before its roles."""

    __table_args__ = (
        # A key's sessions in flight (`admissions.py`: a key's share of the window).
        Index("ix_sessions_api_key_id_status", "api_key_id", "status"),
    )


class CompletionRow(Base):
    """One served model call. The four `*_ids`/`output_*` blobs are packed arrays;
    `min_version` is min(output_versions) (NULL without output tokens), so staleness is a
    column comparison. `parent_id` has no foreign key: a parent whose capture failed must
    not make its children unwritable (`claims.py` drops such episodes). `full_len` and
    `full_hash` are len(prompt_ids + output_ids) and the hex blake2b-128 of their packed
    int32 bytes: parent linking (`linking.py`) compares hashes, never arrays."""

    __tablename__ = "completions"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    session_id: Mapped[str | None] = mapped_column(
        ForeignKey("sessions.id", ondelete="CASCADE"), index=True
    )
    api_key_id: Mapped[str | None] = mapped_column(String)
    parent_id: Mapped[str | None] = mapped_column(String, index=True)
    model: Mapped[str] = mapped_column(String)
    request_json: Mapped[dict[str, Any]] = mapped_column(JSON)
    response_json: Mapped[dict[str, Any]] = mapped_column(JSON)
    prompt_ids: Mapped[bytes] = mapped_column(LargeBinary)
    output_ids: Mapped[bytes] = mapped_column(LargeBinary)
    output_logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    output_versions: Mapped[bytes] = mapped_column(LargeBinary)
    min_version: Mapped[int | None] = mapped_column(Integer)
    finish_reason: Mapped[str] = mapped_column(String(32))
    temperature: Mapped[float] = mapped_column(Float)
    top_p: Mapped[float] = mapped_column(Float)
    top_k: Mapped[int] = mapped_column(Integer)
    backend: Mapped[str] = mapped_column(String)
    latency_ms: Mapped[float] = mapped_column(Float)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float, index=True)
    full_len: Mapped[int | None] = mapped_column(Integer)
    full_hash: Mapped[str | None] = mapped_column(String(32))
    requested_model: Mapped[str | None] = mapped_column(String)
    """The model name the client sent (`model` is the policy that served it)."""
    continuity_key: Mapped[str | None] = mapped_column(String)
    """`<messages>:<prompt digest>:<reply digest>`: lets a later turn of the session,
    served by any gateway process, continue this completion's ids
    (`gateway/continuity.py`); NULL without a session."""


class RewardRow(Base):
    """A named score; `id` is chosen by the client, which makes posting idempotent, and
    unique per `owner` (the posting key's id, "" for the admin): one key's ids are
    invisible to another."""

    __tablename__ = "rewards"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    value: Mapped[float] = mapped_column(Float)
    name: Mapped[str] = mapped_column(String)
    completion_id: Mapped[str | None] = mapped_column(
        ForeignKey("completions.id", ondelete="CASCADE"), index=True
    )
    session_id: Mapped[str | None] = mapped_column(
        ForeignKey("sessions.id", ondelete="CASCADE"), index=True
    )
    group_id: Mapped[str | None] = mapped_column(String, index=True)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)
    created_at: Mapped[float] = mapped_column(Float)
    owner: Mapped[str] = mapped_column(String, primary_key=True, server_default="")


class WeightVersionRow(Base):
    """A published policy version (checkpoint directory plus swap timings); versions
    count per policy, so (policy, version) is the key."""

    __tablename__ = "weight_versions"

    policy: Mapped[str] = mapped_column(String, primary_key=True, server_default="default")
    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    path: Mapped[str] = mapped_column(String)
    created_at: Mapped[float] = mapped_column(Float)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)


class TrainStepRow(Base):
    """One optimizer step and its metrics. `version` has no foreign key: the step row may
    be written before the version it produced is published."""

    __tablename__ = "train_steps"

    policy: Mapped[str] = mapped_column(String, primary_key=True, server_default="default")
    step: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    version: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float)


class KeyCounterRow(Base):
    """One gateway process's (`holder`'s) live counts for one key with limits, published
    every `gateway.limits.key_limits_sync_s` so the other processes sharing the store count them
    too (`key_counters.py`). A row not updated recently belongs to a gone process and is
    ignored (and deleted later)."""

    __tablename__ = "key_counters"

    key_id: Mapped[str] = mapped_column(String, primary_key=True)
    holder: Mapped[str] = mapped_column(String, primary_key=True)
    requests: Mapped[int] = mapped_column(Integer)
    """Requests admitted in the last minute."""
    tokens: Mapped[int] = mapped_column(BigInteger)
    """Tokens used in the last minute."""
    in_flight: Mapped[int] = mapped_column(Integer)
    unflushed_tokens: Mapped[int] = mapped_column(BigInteger)
    """Tokens counted but not yet added to `api_keys.tokens_used`."""
    updated_at: Mapped[float] = mapped_column(Float)


class LeaseRow(Base):
    """A named lease (e.g. the gateway leader's): held by `holder` until `expires_at`;
    another holder may take it only after that (`leases.py`)."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String, primary_key=True)
    holder: Mapped[str] = mapped_column(String)
    expires_at: Mapped[float] = mapped_column(Float)


class AuthFailureRow(Base):
    """One gateway process's (`holder`'s) failed-credential count for one client address,
    published once a sync interval when it changed, so every process sharing the store
    locks the address out on the sum (`auth_failures.py`). Rows quiet for longer than the
    longest lock-out count for nothing and are deleted."""

    __tablename__ = "auth_failures"

    address: Mapped[str] = mapped_column(String, primary_key=True)
    holder: Mapped[str] = mapped_column(String, primary_key=True)
    failures: Mapped[int] = mapped_column(Integer)
    last_failure: Mapped[float] = mapped_column(Float, index=True)
    locked_until: Mapped[float] = mapped_column(Float)


class AdmissionRow(Base):
    """Places in the staleness window held while a gateway process inserts the sessions
    it admitted (`admissions.py`); deleted once they exist, ignored after `expires_at`
    (a process that died in between)."""

    __tablename__ = "admissions"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    count: Mapped[int] = mapped_column(Integer)
    expires_at: Mapped[float] = mapped_column(Float)
    policy: Mapped[str] = mapped_column(String, default="default", server_default="default")
    """The policy whose staleness window the places are held in."""
    api_key_id: Mapped[str | None] = mapped_column(String)
    """The user key the places are held for (its share of the window); None: none."""


class ConsoleRevocationRow(Base):
    """A signed-out console cookie (its nonce), refused by every gateway process until
    the cookie would have expired anyway (`revocations.py`)."""

    __tablename__ = "console_revocations"

    nonce: Mapped[str] = mapped_column(String, primary_key=True)
    expires_at: Mapped[float] = mapped_column(Float)


class PolicyRow(Base):
    """A policy created at runtime (`policy_registry.py`); config-declared policies are
    not stored. The name is the primary key, so two creators racing for one name get one
    row and one IntegrityError."""

    __tablename__ = "policies"

    name: Mapped[str] = mapped_column(String, primary_key=True)
    lora: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float)
    roles: Mapped[list[str] | None] = mapped_column(JSON)
    """The policies its episodes may open as roles (None: none)."""
    updated_at: Mapped[float | None] = mapped_column(Float)
    """When its roles last changed (None: never): part of the refreshers' mark."""


class PolicyModelNameRow(Base):
    """A request model name that picks a runtime policy. One row per name, the name the
    key: an alias taken by another policy fails the insert in the policy's transaction,
    whichever process created the other one."""

    __tablename__ = "policy_model_names"

    model_name: Mapped[str] = mapped_column(String, primary_key=True)
    policy: Mapped[str] = mapped_column(String, index=True)
