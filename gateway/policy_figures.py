"""Per-policy figures read from the store and the gateway state: what the console's
Policies pages and the per-scrape `areal_policy_*` gauges of `/metrics` show (the ones
the gateway keeps itself, versions, swaps and rewards, are in `gateway/metrics.py`).
Three grouped queries for every policy together (sessions by policy and status, newest
version, newest train step), whatever the number of policies: an admin path (a page
view or a scrape), never per request. Blocking: callers run it through
`asyncio.to_thread`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from areal_service.types import DEFAULT_POLICY, TrainStepRecord, WeightVersionRecord
from gateway.admission import window
from gateway.state import GatewayState

SESSION_STATES = ("open", "ended", "claimed", "trained", "dropped")


@dataclass(frozen=True, slots=True)
class PolicyFigures:
    """One policy's figures at the time of the read."""

    name: str
    model_names: list[str]
    """Request model names that pick this policy whatever the key's."""
    lora_rank: int | None
    """None: full fine-tuning (the default policy without `default_policy.lora`)."""
    live_version: int
    """The version this gateway serves (the default policy's is `live_version`)."""
    latest: WeightVersionRecord | None
    """The newest version its trainer published (None before the first)."""
    last_step: TrainStepRecord | None
    sessions: dict[str, int] = field(default_factory=dict)
    """Sessions by status (statuses with none are absent)."""
    staleness_window: int = 0
    """The staleness rule's capacity at this policy's live version (`gateway/admission.py`:
    (η + version + 1) · batch_sessions)."""

    @property
    def admitted(self) -> int:
        """Sessions holding a place in the window: every one not dropped."""
        return sum(n for status, n in self.sessions.items() if status != "dropped")

    @property
    def published_version(self) -> int:
        return 0 if self.latest is None else self.latest.version


def live_version_of(state: GatewayState, policy: str) -> int:
    """The version of `policy` this gateway serves (0: the base model / untrained v0)."""
    if policy == DEFAULT_POLICY:
        return state.live_version
    return state.policy_versions.get(policy, 0)


def policy_figures(state: GatewayState) -> list[PolicyFigures]:
    """Every policy (`default` first, then the declared ones in order) with its figures."""
    store, registry = state.store, state.policy_registry
    sessions = store.count_sessions_by_policy()
    latest = store.latest_weight_versions()
    steps = store.latest_train_steps()
    aliases = {p.name: p.model_names for p in registry.declared}
    out = []
    for name in registry.names():
        lora = registry.lora(name)
        live = live_version_of(state, name)
        out.append(
            PolicyFigures(
                name=name,
                model_names=list(aliases.get(name, [])),
                lora_rank=None if lora is None else lora.rank,
                live_version=live,
                latest=latest.get(name),
                last_step=steps.get(name),
                sessions=sessions.get(name, {}),
                staleness_window=window(state, live),
            )
        )
    return out


class _PolicyCollector(Collector):
    def __init__(self, figures: Sequence[PolicyFigures]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        sessions = GaugeMetricFamily(
            "areal_policy_sessions", "Sessions per policy and state", labels=["policy", "state"]
        )
        admitted = GaugeMetricFamily(
            "areal_policy_admitted_sessions",
            "Sessions holding a place in the policy's staleness window (not dropped)",
            labels=["policy"],
        )
        windows = GaugeMetricFamily(
            "areal_policy_staleness_window",
            "Sessions the staleness rule allows at the policy's live version",
            labels=["policy"],
        )
        published = GaugeMetricFamily(
            "areal_policy_published_version",
            "The policy's newest published version (0 before the first)",
            labels=["policy"],
        )
        step = GaugeMetricFamily(
            "areal_policy_train_step", "The policy's newest train step", labels=["policy"]
        )
        loss = GaugeMetricFamily(
            "areal_policy_train_loss", "Loss of the policy's newest train step", labels=["policy"]
        )
        reward = GaugeMetricFamily(
            "areal_policy_train_reward",
            "Mean session return (task_reward) of the policy's newest train step",
            labels=["policy"],
        )
        for f in self._figures:
            for state in SESSION_STATES:
                sessions.add_metric([f.name, state], f.sessions.get(state, 0))
            admitted.add_metric([f.name], f.admitted)
            windows.add_metric([f.name], f.staleness_window)
            published.add_metric([f.name], f.published_version)
            if f.last_step is not None:
                step.add_metric([f.name], f.last_step.step)
                if "loss" in f.last_step.metrics:
                    loss.add_metric([f.name], f.last_step.metrics["loss"])
                if "task_reward" in f.last_step.metrics:
                    reward.add_metric([f.name], f.last_step.metrics["task_reward"])
        yield from (sessions, admitted, windows, published, step, loss, reward)


def policy_exposition(figures: Sequence[PolicyFigures]) -> bytes:
    """Per-policy figures read from the store per scrape (`gateway/policy_figures.py`):
    sessions by state, admitted sessions, staleness window, newest published version and
    the newest train step's loss and reward. Like the audit, the same numbers from every
    worker, so not kept in a worker's registry."""
    registry = CollectorRegistry()
    registry.register(_PolicyCollector(figures))
    return generate_latest(registry)
