"""Admin REST: virtual keys (create: plaintext shown once; list; revoke; per-key limits),
status, the episode audit, export and policies (list; create at runtime). Admin key
only."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import tempfile
from typing import Annotated, Any, Literal, TypedDict, cast

from fastapi import APIRouter, Body, Response
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.concurrency import iterate_in_threadpool

from areal_service.config import LoRAConfig
from areal_service.export import ExportFilters, export_sequences, iter_export_rows
from areal_service.keys import new_api_key
from areal_service.policy_registry import lora_over_default
from areal_service.store.audit import EpisodeAudit
from areal_service.types import DEFAULT_POLICY, ApiKeyRecord, KeyKind, WeightVersionRecord
from gateway.admission import window
from gateway.deps import AdminDep, PageLimit, PageOffset, StateDep
from gateway.errors import ErrorBody, OpenAIError
from gateway.leader import LEADER_LEASE
from gateway.policies import checked_policy, refresh_policies, set_policy_roles
from gateway.policies import create_policy as create_runtime_policy
from gateway.policies import delete_policy as delete_runtime_policy
from gateway.policy_figures import live_version_of
from gateway.routes.views import record_view
from gateway.state import GatewayState

router = APIRouter(
    prefix="/admin", responses={code: {"model": ErrorBody} for code in (400, 401, 403, 404)}
)


LimitValue = Annotated[int | None, Field(ge=1, le=2**53)]
LIMIT_FIELDS = ("rpm_limit", "tpm_limit", "max_concurrent", "token_budget")


class KeyLimits(TypedDict, total=False):
    """Some of a key's limits by `LIMIT_FIELDS` name, as `ApiKeyRecord` types them."""

    rpm_limit: int | None
    tpm_limit: int | None
    max_concurrent: int | None
    token_budget: int | None


class _ExportOptions(TypedDict):
    """The trainer's settings an export applies (`iter_export_rows` keywords)."""

    turn_discount: float
    default_reward: float | None


class KeyLimitsBody(BaseModel):
    """Body of `PATCH /admin/keys/{key_id}`: the limits to change (an absent field keeps
    its value, `null` removes the limit). 429 with retry-after past one."""

    model_config = ConfigDict(extra="forbid", strict=True)
    rpm_limit: LimitValue = None
    """Requests per minute."""
    tpm_limit: LimitValue = None
    """Prompt + completion tokens per minute."""
    max_concurrent: LimitValue = None
    """Requests in flight at once."""
    token_budget: LimitValue = None
    """Total prompt + completion tokens, ever (`tokens_used` counts them)."""

    def given(self) -> dict[str, int | None]:
        """Only the limits the client sent."""
        return {name: getattr(self, name) for name in self.model_fields_set if name in LIMIT_FIELDS}


class KeyCreate(KeyLimitsBody):
    """Body of `POST /admin/keys` (limits optional: none means unlimited)."""

    name: str = Field("", max_length=200)
    metadata: dict[str, Any] = Field(default_factory=dict)
    policy: str | None = Field(None, max_length=63)
    """The policy (`policies:`) the key's sessions are served and trained by; none: the
    default policy. Fixed for the key's life."""


class KeyView(BaseModel):
    """A key as lists show it: never the hash or the plaintext."""

    id: str
    name: str
    display: str
    kind: KeyKind
    session_id: str | None
    created_at: float
    last_used_at: float | None
    revoked_at: float | None
    rpm_limit: int | None = None
    tpm_limit: int | None = None
    max_concurrent: int | None = None
    token_budget: int | None = None
    tokens_used: int = 0
    """As last flushed (`gateway.auth.key_usage_interval_s`)."""
    policy: str = DEFAULT_POLICY
    """The policy the key is bound to."""

    @classmethod
    def of(cls, key: ApiKeyRecord) -> KeyView:
        return record_view(cls, key)


class KeyCreated(KeyView):
    api_key: str
    """The plaintext key: shown only here."""


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyView]


class BackendView(BaseModel):
    url: str
    healthy: bool
    in_flight: int
    last_error: str


class GatewayStatus(BaseModel):
    live_version: int
    model: str
    backends: list[BackendView]
    open_sessions: int
    started_sessions: int
    admitted_sessions: int
    """Sessions holding a place in the staleness window (every one not dropped)."""
    staleness_gate: bool
    staleness_window: int
    """How many admitted sessions the staleness gate allows by now."""
    worker_pid: int
    """The gateway process that answered (one of `gateway.scale.workers`)."""
    leader: bool
    """Whether that process holds the leader lease (swaps weights, sweeps sessions)."""
    leader_holder: str | None
    """Who holds the lease (host:pid:tag), as the store says."""
    chat_template_renders_tools: bool
    """Whether the chat template writes requests' `tools` into the prompt. False: tool
    definitions never reach the model (set `engine.chat_template`, e.g.
    `builtin:chatml-tools`)."""


def key_view(key: ApiKeyRecord) -> dict[str, Any]:
    """A key as the console's templates show it (`KeyView` as a dict)."""
    return KeyView.of(key).model_dump()


@router.post("/keys", status_code=201)
async def create_key(
    state: StateDep, _: AdminDep, body: Annotated[KeyCreate | None, Body()] = None
) -> KeyCreated:
    """Create a virtual key; the response carries the plaintext, the only time it is shown."""
    body = body or KeyCreate()
    policy = await checked_policy(state, body.policy)
    plaintext, record = new_api_key(name=body.name)
    # cast: given() holds only LIMIT_FIELDS keys, which a comprehension cannot show.
    limits = cast(KeyLimits, body.given())
    record = dataclasses.replace(record, metadata=body.metadata, policy=policy, **limits)
    await asyncio.to_thread(state.store.keys.add_api_key, record)
    state.keys.remember(record)  # first use needs no lookup (and passes the auth throttle)
    return record_view(KeyCreated, record, api_key=plaintext)


@router.patch("/keys/{key_id}")
async def set_key_limits(key_id: str, body: KeyLimitsBody, state: StateDep, _: AdminDep) -> KeyView:
    """Change a key's limits (effective at once on this replica)."""
    return KeyView.of(await apply_key_limits(state, key_id, body.given()))


async def apply_key_limits(
    state: GatewayState, key_id: str, limits: dict[str, int | None]
) -> ApiKeyRecord:
    """Store `limits` on the key and drop its cached record (404 if unknown)."""
    key = await asyncio.to_thread(state.store.keys.set_api_key_limits, key_id, limits)
    if key is None:
        raise OpenAIError(404, f"no key with id {key_id!r}", param="key_id", code="key_not_found")
    state.keys.forget(key.key_hash)
    return key


@router.get("/keys")
async def list_keys(
    state: StateDep, _: AdminDep, limit: PageLimit = 100, offset: PageOffset = 0
) -> KeyList:
    """Virtual keys, newest first (at most 1000 per page)."""
    keys = await asyncio.to_thread(
        state.store.keys.list_api_keys, limit=min(limit, 1000), offset=offset
    )
    return KeyList(data=[KeyView.of(k) for k in keys])


@router.post("/keys/{key_id}/revoke")
@router.delete("/keys/{key_id}")
async def revoke_key(key_id: str, state: StateDep, _: AdminDep) -> KeyView:
    """Revoke a key: later requests with it get 401 (at once on this replica)."""
    key = await asyncio.to_thread(state.store.keys.get_api_key, key_id)
    if key is None:
        raise OpenAIError(404, f"no key with id {key_id!r}", param="key_id", code="key_not_found")
    revoked = await asyncio.to_thread(state.store.keys.revoke_api_key, key_id)
    state.keys.forget(key.key_hash)
    assert revoked is not None
    return KeyView.of(revoked)


@router.get("/status")
async def status(state: StateDep, _: AdminDep) -> GatewayStatus:
    """Live weight version, backends, open sessions and the staleness window."""
    open_sessions = await asyncio.to_thread(state.store.count_sessions, status="open")
    started = await asyncio.to_thread(state.store.count_sessions)
    admitted = await asyncio.to_thread(state.store.count_admitted_sessions)
    return GatewayStatus(
        live_version=state.live_version,
        model=state.config.gateway.model_name,
        backends=[
            BackendView(
                url=s.url, healthy=s.healthy, in_flight=s.in_flight, last_error=s.last_error
            )
            for s in state.backends.status()
        ],
        open_sessions=open_sessions,
        started_sessions=started,
        admitted_sessions=admitted,
        staleness_gate=state.config.gateway.sessions.staleness_gate,
        staleness_window=window(state, state.live_version),
        worker_pid=os.getpid(),
        leader=state.leadership.is_leader,
        leader_holder=await asyncio.to_thread(state.store.coordination.lease_holder, LEADER_LEASE),
        chat_template_renders_tools=state.tokenizer.renders_tools,
    )


class EpisodeAuditView(BaseModel):
    """`GET /admin/episodes/audit`: where every episode (session) is. `states`: sessions
    per status (open, ended, claimed, trained, dropped); `dropped_by_reason`: the dropped
    by reason kind (stale, unrewarded, failed, group incomplete, no completions, missing
    parent); `overdue`: ended sessions claimable for longer than every settling window
    (no trainer is taking them); `unaccounted`: sessions no rule will ever move (must be
    0), with `unaccounted_why`."""

    object: Literal["episode_audit"] = "episode_audit"
    total: int
    states: dict[str, int]
    dropped_by_reason: dict[str, int]
    overdue: int
    unaccounted: int
    unaccounted_why: dict[str, int]

    @classmethod
    def of(cls, audit: EpisodeAudit) -> EpisodeAuditView:
        return record_view(cls, audit)


@router.get("/episodes/audit")
async def episodes_audit(state: StateDep, _: AdminDep) -> EpisodeAuditView:
    """Every session's state; `unaccounted` must be 0 (see `store/audit.py`)."""
    audit = await asyncio.to_thread(state.store.episode_audit, state.config.trainer)
    return EpisodeAuditView.of(audit)


@router.get("/export")
async def export(
    state: StateDep,
    _: AdminDep,
    format: str = "jsonl",  # noqa: A002
    group_id: str | None = None,
    task_id: str | None = None,
    dropped: bool = False,
) -> Response:
    """Training sequences as JSONL (streamed page by page) or Parquet (written to a
    temporary file in a thread, then sent); `dropped`: the dropped sessions' too (a
    deleted policy's, say)."""
    filters = ExportFilters.of(group_id, task_id, dropped=dropped)
    trainer = state.config.trainer
    options: _ExportOptions = {
        "turn_discount": trainer.turn_discount,
        "default_reward": trainer.unrewarded_return(),
    }
    if format == "jsonl":
        rows = iter_export_rows(state.store, filters, **options)
        lines = (json.dumps(row, separators=(",", ":")) + "\n" for row in rows)
        return StreamingResponse(
            iterate_in_threadpool(lines),
            media_type="application/x-ndjson",
            headers={"content-disposition": "attachment; filename=export.jsonl"},
        )
    if format != "parquet":
        raise OpenAIError(400, "format must be jsonl or parquet", param="format")
    fd, path = tempfile.mkstemp(suffix=".parquet")
    os.close(fd)
    await asyncio.to_thread(
        export_sequences, state.store, fmt="parquet", out=path, filters=filters, **options
    )
    return FileResponse(
        path,
        filename="export.parquet",
        media_type="application/octet-stream",
        background=BackgroundTask(os.unlink, path),
    )


class PolicyCreate(BaseModel):
    """Body of `POST /admin/policies`: a named LoRA policy on the shared base model.
    The name's rules (pattern, reserved names) and the adapter's ranges are checked with
    the config's (`PolicyConfig`, `LoRAConfig`): 400 for bad input, 409 for a name or a
    model name taken."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=63)
    """Also the adapter's served name and `weights/<name>/`: `[a-z0-9][a-z0-9_-]*`."""
    lora: LoRAConfig | None = None
    """rank, alpha, target_modules (and dropout); none: `default_policy.lora`'s."""
    model_names: list[str] = Field(default_factory=list, max_length=64)
    """Request model names that pick this policy (unique across every policy)."""
    roles: list[str] = Field(default_factory=list, max_length=64)
    """The named policies its episodes may open as roles (each must exist)."""


class PolicyUpdate(BaseModel):
    """Body of `PATCH /admin/policies/{name}`: a runtime policy's roles (checked as on
    creation; a config-declared policy's are the config's: 409)."""

    model_config = ConfigDict(extra="forbid")
    roles: list[str] = Field(max_length=64)
    """The named policies its episodes may open as roles, replacing the old list."""


class PolicyDeleted(BaseModel):
    """Reply of `DELETE /admin/policies/{name}`."""

    name: str
    deleted: Literal[True] = True
    sessions_dropped: int
    """Its sessions not trained yet, now `dropped` with reason `policy_deleted: ...`
    (what they recorded stays for export)."""


class PolicyView(BaseModel):
    """A policy as `GET /admin/policies` shows it."""

    name: str
    source: Literal["config", "runtime"]
    """Declared in the config (`policies:`, and `default`) or created at runtime."""
    weights: Literal["lora", "full"]
    """A LoRA adapter on the shared base, or its own full weights (served by its own
    backends: `backends`)."""
    backends: list[str] = Field(default_factory=list)
    """A full-weight policy's own backends (empty: it shares the main pool)."""
    live_version: int
    """The version this gateway serves (0: the base model, the untrained version)."""
    model_names: list[str]
    """Request model names that pick this policy whatever the key's."""
    roles: list[str] = Field(default_factory=list)
    """The policies its episodes may open as roles."""
    lora_rank: int | None
    """The adapter's rank (None: full fine-tuning, the default policy without LoRA)."""
    lora_alpha: float | None = None
    target_modules: list[str] | None = None
    latest_version: int | None
    """The newest version its trainer published (None before the first)."""
    latest_version_at: float | None
    created_at: float | None = None
    """When a runtime policy was created (None for the config's)."""


class PolicyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[PolicyView]


def policy_views(state: GatewayState, latest: dict[str, WeightVersionRecord]) -> list[PolicyView]:
    """Every policy (`default`, the config's, then the runtime ones) as the API and the
    console show it, with its latest published version from `latest`."""
    registry = state.policy_registry
    views = []
    for plan in registry.plan.policies.values():
        name, lora, version = plan.name, plan.lora, latest.get(plan.name)
        runtime = registry.runtime.get(name)
        pool = state.policy_pools.get(name)
        views.append(
            PolicyView(
                name=name,
                source=plan.source,
                weights=plan.weights,
                backends=[] if pool is None else [b.url for b in pool.backends],
                live_version=live_version_of(state, name),
                model_names=list(plan.model_names),
                roles=list(plan.roles),
                lora_rank=None if lora is None else lora.rank,
                lora_alpha=None if lora is None else lora.alpha,
                target_modules=None if lora is None else lora.target_modules,
                latest_version=None if version is None else version.version,
                latest_version_at=None if version is None else version.created_at,
                created_at=None if runtime is None else runtime.created_at,
            )
        )
    return views


@router.get("/policies")
async def list_policies(state: StateDep, _: AdminDep) -> PolicyList:
    """Every policy, the config's (`default` first) and the runtime ones, with its latest
    published version (the runtime ones re-read from the store first)."""
    await refresh_policies(state)
    latest = await asyncio.to_thread(state.store.latest_weight_versions)
    return PolicyList(data=policy_views(state, latest))


@router.post("/policies", status_code=201, responses={409: {"model": ErrorBody}})
async def create_policy(state: StateDep, _: AdminDep, body: PolicyCreate) -> PolicyView:
    """Create a LoRA policy at runtime: kept in the store, so every gateway process and
    the launcher (which starts its trainer) see it. Keys and sessions may be bound to it
    at once; it serves the base model (its untrained version 0) until its trainer
    publishes."""
    lora = None
    if body.lora is not None:  # the fields not given are the default policy's, as in the CLI
        given = body.lora.model_dump(mode="json", include=body.lora.model_fields_set)
        lora = lora_over_default(state.config, given)
    record = await create_runtime_policy(state, body.name, lora, body.model_names, body.roles)
    return next(v for v in policy_views(state, {}) if v.name == record.name)


@router.patch("/policies/{name}", responses={404: {"model": ErrorBody}, 409: {"model": ErrorBody}})
async def update_policy(state: StateDep, _: AdminDep, name: str, body: PolicyUpdate) -> PolicyView:
    """Set a runtime policy's roles (the policies its episodes may open): 400 for a
    role that is not a named policy or is listed twice, 409 for a config-declared one."""
    await set_policy_roles(state, name, body.roles)
    latest = await asyncio.to_thread(state.store.latest_weight_versions)
    return next(v for v in policy_views(state, latest) if v.name == name)


@router.delete("/policies/{name}", responses={404: {"model": ErrorBody}, 409: {"model": ErrorBody}})
async def remove_policy(state: StateDep, _: AdminDep, name: str) -> PolicyDeleted:
    """Delete a runtime policy: its untrained sessions are dropped with a reason (their
    records kept for export), keys bound to it get 403 `policy_deleted`, its adapter is
    unloaded where the engine can, its trainer stops. 409 for `default`, a
    config-declared policy, or a role of another policy; 404 for an unknown one."""
    dropped = await delete_runtime_policy(state, name)
    return PolicyDeleted(name=name, sessions_dropped=dropped)
