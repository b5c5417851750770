"""The staleness gate (`gateway/admission.py`) on a real store: the window's boundary
at exactly (η + version + 1) · batch sessions, dropped sessions giving their place back
(no deadlock however many are dropped), and the window reopening as versions go live."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from areal_service.config import (
    DefaultPolicyConfig,
    GatewayConfig,
    LoRAConfig,
    PolicyConfig,
    ServiceConfig,
    SessionsConfig,
    TrainerConfig,
)
from areal_service.policy_registry import PolicyRegistry
from areal_service.store import TrajectoryStore
from areal_service.store.claims import EpisodeClaimer
from areal_service.types import DEFAULT_POLICY, CompletionRecord, RewardRecord, SessionRecord
from gateway import admission as gate_module
from gateway.admission import admit_sessions
from gateway.errors import OpenAIError
from gateway.state import GatewayState


@dataclass
class GateState:
    """What `admit_sessions` reads of the gateway's state."""

    config: ServiceConfig
    store: TrajectoryStore
    live_version: int = 0
    policy_versions: dict[str, int] = field(default_factory=dict)
    admission_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    versions_moved: asyncio.Event = field(default_factory=asyncio.Event)
    policy_registry: PolicyRegistry = field(init=False)

    def __post_init__(self) -> None:
        self.policy_registry = PolicyRegistry(self.config)

    notice_versions_moved = GatewayState.notice_versions_moved


def gate(
    store: TrajectoryStore,
    *,
    eta: int,
    batch_groups: int = 1,
    group_size: int = 2,
    policies: tuple[str, ...] = (),
    wait_s: float = 0.0,
) -> GateState:
    trainer = TrainerConfig(
        max_staleness=eta,
        batch_groups=batch_groups,
        group_size=group_size,
    )
    gateway = GatewayConfig(sessions=SessionsConfig(staleness_gate=True, admit_wait_s=wait_s))
    declared = [PolicyConfig(name=p) for p in policies]
    default = DefaultPolicyConfig(lora=LoRAConfig() if policies else None)
    config = ServiceConfig(
        trainer=trainer, gateway=gateway, default_policy=default, policies=declared
    )
    return GateState(config, store)


def start(
    state: GateState,
    count: int = 1,
    *,
    group_id: str | None = None,
    policy: str = DEFAULT_POLICY,
) -> list[str]:
    """Admit and insert `count` sessions; OpenAIError 429 when the window is full."""

    async def run() -> list[str]:
        async with admit_sessions(state, count, policy) as admission:  # type: ignore[arg-type]
            ids = [f"s-{uuid.uuid4().hex[:8]}" for _ in range(count)]
            for sid in ids:
                state.store.add_session(
                    SessionRecord(id=sid, group_id=group_id, policy=policy), admission
                )
            return ids

    return asyncio.run(run())


def refused(state: GateState, count: int = 1, policy: str = DEFAULT_POLICY) -> str | None:
    """The 429's message when the window is full, else None (and the sessions are in)."""
    try:
        start(state, count, policy=policy)
    except OpenAIError as error:
        assert error.status == 429
        return error.message
    return None


def finish(store: TrajectoryStore, ids: list[str], *, version: int = 0) -> None:
    """One completion generated at `version`, a reward and the end, for each session."""
    for sid in ids:
        store.add_completion(
            CompletionRecord(
                id=f"{sid}-c",
                model="m",
                prompt_ids=(1, 2),
                output_ids=(3,),
                output_logprobs=(-0.1,),
                output_versions=(version,),
                finish_reason="stop",
                session_id=sid,
            )
        )
        store.add_reward(RewardRecord(id=f"{sid}-r", value=1.0, session_id=sid))
        store.end_session(sid, "reward")


def claim(claimer: EpisodeClaimer, version: int, max_staleness: int):
    return claimer.claim_groups(
        group_size=2,
        max_groups=8,
        current_version=version,
        max_staleness=max_staleness,
        claimer="t",
    )


def test_window_boundary_is_exactly_eta_plus_version_plus_one_batches(store):
    state = gate(store, eta=1)  # (1 + 0 + 1) * 2 = 4 sessions at v0
    for _ in range(4):
        start(state)  # the 4th fills the window exactly: still admitted
    assert store.count_admitted_sessions() == 4
    assert refused(state)
    state.live_version = 1  # one more batch: 6
    start(state, 2)
    assert refused(state)
    assert store.count_admitted_sessions() == 6  # a refusal leaves no reservation behind


def test_many_drops_in_a_row_never_close_the_gate(store):
    state = gate(store, eta=0)  # one batch (2 sessions) in flight at v0
    claimer = EpisodeClaimer(store)
    for round_ in range(6):
        ids = start(state, 2, group_id=f"g{round_}")
        assert refused(state)  # the window is full while they run
        finish(store, ids, version=0)
        result = claim(claimer, version=3, max_staleness=0)  # 3 versions old: dropped
        assert result.groups == () and result.dropped[0].reason.startswith("stale")
    assert store.count_sessions(status="dropped") == 12
    assert start(state, 2)  # 12 dropped sessions took no place in the window


def test_trained_sessions_keep_their_place_until_the_version_goes_live(store):
    state = gate(store, eta=0)
    claimer = EpisodeClaimer(store)
    ids = start(state, 2, group_id="g")
    finish(store, ids)
    (group,) = claim(claimer, version=0, max_staleness=0).groups
    assert claimer.mark_trained(group.claim_id) == 2
    assert refused(state)  # trained into v1, which is not live yet
    state.live_version = 1
    assert start(state, 2)

    assert refused(gate(store, eta=0), 3)  # a group larger than the window: never in


def test_each_policy_has_its_own_window_at_its_own_version(store):
    """With declared policies, each policy's window counts only its sessions and widens
    only with its own trained version (its trainer's); the 429 names the policy. The
    default policy's window follows `live_version`, as without policies."""
    state = gate(store, eta=0, policies=("solver", "verifier"))  # 2 sessions a window at v0
    start(state, 2, policy="solver")
    message = refused(state, policy="solver")
    assert message is not None and "policy 'solver'" in message and "2 of its 2" in message
    start(state, 2, policy="verifier")  # the solver's full window is not the verifier's
    start(state, 2)  # nor the default policy's
    assert refused(state, policy="verifier") and refused(state)
    state.policy_versions["solver"] = 1  # the solver's trainer published v1, now live
    start(state, 2, policy="solver")
    assert refused(state, policy="solver") and refused(state, policy="verifier")
    assert refused(state)  # the default policy is still at v0
    state.live_version = 1
    start(state, 2)
    assert refused(state, policy="verifier")


def test_a_waiting_start_wakes_when_a_version_goes_live_not_by_polling(store, monkeypatch):
    """A start waiting at a full window asks the store again when the weight syncer
    notices a version change, not on a short timer: with the recheck an hour away, only
    the notice can admit it; and the server's stop answers it at once too."""
    monkeypatch.setattr(gate_module, "RECHECK_S", 3600.0)
    state = gate(store, eta=0, wait_s=3600.0)
    start(state, 2)  # the whole window at v0

    async def run() -> None:
        async def begin(*ids: str) -> None:
            async with admit_sessions(state, len(ids)) as admission:  # type: ignore[arg-type]
                for sid in ids:
                    state.store.add_session(SessionRecord(id=sid), admission)

        waiting = asyncio.create_task(begin("late"))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # the window is full
        state.live_version = 1
        state.notice_versions_moved()
        await asyncio.wait_for(waiting, 10)

        stopped = asyncio.create_task(begin("a", "b"))  # v1's window has 1 place left
        await asyncio.sleep(0.3)
        assert not stopped.done()
        state.stopping.set()
        try:
            await asyncio.wait_for(stopped, 10)
        except OpenAIError as error:
            assert error.status == 503
        else:
            raise AssertionError("a waiting start was admitted after the stop")

    asyncio.run(run())
    assert store.get_session("late") is not None
