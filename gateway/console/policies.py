"""Data shaping for the console's Policies pages: the list (one row per policy, from
`gateway/policy_figures.py`) and one policy's page (its figures, train-step series and
versions with the gateway's swap timings). The console is the admin's only (`auth.py`:
only the admin key signs in), so every policy is shown; tenants never reach these pages.
Synchronous and hitting the database: routes call them through `asyncio.to_thread`.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_service.types import TrainStepRecord
from gateway.console.views import WeightRow, weight_rows
from gateway.policy_figures import PolicyFigures, policy_figures
from gateway.state import GatewayState

STEPS_SHOWN = 20
"""Newest steps in the policy page's table (the charts draw every step)."""


@dataclass(frozen=True, slots=True)
class PolicyPage:
    """Everything one policy's page shows."""

    figures: PolicyFigures
    steps: list[TrainStepRecord]
    """The newest `STEPS_SHOWN` steps, newest first."""
    step_count: int
    versions: list[WeightRow]
    staleness_gate: bool
    max_staleness: int
    source: str = "config"
    """`config` (and `default`): changed only in the config; `runtime`: its roles may be
    set and it may be deleted here."""
    roles: tuple[str, ...] = ()
    """The policies its episodes may open as roles."""
    others: tuple[str, ...] = ()
    """The other named policies (what its roles may name)."""


def policy_list(state: GatewayState) -> list[PolicyFigures]:
    """Every policy, `default` first (three grouped queries)."""
    return policy_figures(state)


def policy_page(state: GatewayState, name: str) -> PolicyPage | None:
    """Policy `name`'s page, or None for a name that is not a policy."""
    found = [f for f in policy_figures(state) if f.name == name]
    if not found:
        return None
    steps = state.store.list_train_steps(limit=100_000, policy=name)
    plan = state.policy_registry.plan
    return PolicyPage(
        source=plan[name].source,
        roles=plan[name].roles,
        others=tuple(p.name for p in plan.named() if p.name != name),
        figures=found[0],
        steps=steps[-STEPS_SHOWN:][::-1],
        step_count=len(steps),
        versions=weight_rows(state.store, policy=name),
        staleness_gate=state.config.gateway.sessions.staleness_gate,
        max_staleness=state.config.trainer.max_staleness,
    )
