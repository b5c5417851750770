"""Everything one gateway app holds: built in `create_app`'s lifespan, torn down there.

Routes reach it through the `Annotated` dependencies in `gateway/deps.py`; nothing here
is a module-level singleton, so tests can run several apps in one process.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from areal_service.config import ServiceConfig
from areal_service.policy_registry import PolicyRegistry
from areal_service.store import TrajectoryStore
from areal_service.store.linking import ParentLinker
from areal_service.store.writer import GroupCommitWriter
from areal_service.types import SessionRecord, role_session_id
from gateway.auth import KeyResolver
from gateway.cache import RefreshingCache
from gateway.continuity import Continuity
from gateway.large_prompts import LargePrompts
from gateway.leader import Leadership
from gateway.metrics import GatewayMetrics
from gateway.routing import BackendPool
from gateway.tokenizer import ChatTokenizer


@dataclass
class GatewayState:
    """The gateway's collaborators and its few pieces of live state."""

    config: ServiceConfig
    store: TrajectoryStore
    writer: GroupCommitWriter
    keys: KeyResolver
    backends: BackendPool
    tokenizer: ChatTokenizer
    context_length: int
    linker: ParentLinker
    session_cache: RefreshingCache[str, SessionRecord]
    """Sessions read or created here (`gateway/cache.py`); dropped when this process ends
    one, so only another replica's change can be seen late (by about its `ttl_s`)."""
    leadership: Leadership
    """The leader lease (`gateway/leader.py`): swaps and sweeps run only while held."""
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    started_at: float = 0.0
    live_version: int = 0
    """Weight version every backend serves (set by the weight syncer on the leader, read
    from the store on followers)."""
    policy_versions: dict[str, int] = field(default_factory=dict)
    """The live adapter version of each declared policy (`policies:`; the default
    policy's is `live_version`), swapped and followed like it."""
    policy_pools: dict[str, BackendPool] = field(default_factory=dict)
    """The backend pool of each policy with its own full weights (`weights: full`,
    `gateway/policy_pools.py`); every other policy is served by `backends`."""
    policy_registry: PolicyRegistry = field(init=False)
    """Every policy, the config's and the runtime ones (refreshed by
    `gateway/policies.py` off the request path)."""
    model_policies: dict[str, str] = field(init=False)
    """Request model name -> policy (every policy's `model_names`; the registry's,
    replaced when it changes)."""
    runtime_policies_seen: tuple[int, str | None, str | None] | None = None
    """The store's runtime policies (count, newest) when this process last read them
    whole (`gateway/policies.py`); None before the first read."""
    admission_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One staleness-gate store transaction at a time from this process."""
    versions_moved: asyncio.Event = field(default_factory=asyncio.Event)
    """Set, and replaced by a fresh one, when this process sees a live version change
    (`notice_versions_moved`): what session starts waiting at the staleness gate wait on
    instead of asking the store again and again (`gateway/admission.py`)."""
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the server begins to stop (`gateway/stopping.py`): what only waits (the
    staleness gate) answers 503 at once rather than being cancelled."""
    continuity: Continuity = field(init=False)
    """Token continuity across turns (`gateway/continuity.py`), built from the config."""
    large_prompts: LargePrompts = field(init=False)
    """The worker thread that renders large prompts off the event loop."""

    def notice_versions_moved(self) -> None:
        """Wake everything waiting on `versions_moved` (the weight syncer, after a round in
        which a live version changed)."""
        self.versions_moved.set()
        self.versions_moved = asyncio.Event()

    def __post_init__(self) -> None:
        gw = self.config.gateway
        self.policy_registry = PolicyRegistry(self.config)
        self.model_policies = self.policy_registry.model_policies
        self.continuity = Continuity(
            self.tokenizer,
            enabled=gw.continuity.enabled,
            max_bytes=gw.continuity.cache_mb * 2**20,
            counter=self.metrics.continuity,
            recent=self.store.recent_turns if gw.capture else None,
            recalls=self.metrics.continuity_recalls,
        )
        self.large_prompts = LargePrompts(
            gw.limits.offload_prompt_chars,
            gw.limits.offload_max_prompts,
            gw.limits.offload_messages,
        )

    async def end_session(self, session_id: str, reason: str) -> SessionRecord | None:
        """End a session in the store and forget what this process cached about it
        (again after the write: a reload may have raced it). The store ends the episode's
        role sub-sessions with it; their derived ids are forgotten here too (one per
        declared policy, none without `policies:`)."""
        ids = [
            session_id,
            *(role_session_id(session_id, p.name) for p in self.policy_registry.declared),
        ]
        for sid in ids:
            self.session_cache.forget(sid)
            self.continuity.cache.forget(sid)  # no later turn will extend it
        ended = await asyncio.to_thread(self.store.end_session, session_id, reason)
        for sid in ids:
            self.session_cache.forget(sid)
        return ended
