"""Prometheus metrics of the gateway, one registry per app (no import-time globals).

With several gateway workers (`gateway/server.py`), prometheus_client's multiprocess
mode keeps every worker's values in files under `PROMETHEUS_MULTIPROC_DIR` (set before
the workers start: the library picks its value store at import), and `/metrics` and the
console read the sum over all workers from there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from areal_service.store.audit import EpisodeAudit

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
SWAP_PHASES = ("pause", "update", "continue", "total")
"""Per-backend phases of a swap (`gateway.backends.SwapTimings`, recorded as `<phase>_s`)."""


class GatewayMetrics:
    """Request, token, latency and capture metrics, labelled by route."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "areal_requests", "Requests served", ["route", "status"], registry=self.registry
        )
        self.prompt_tokens = Counter(
            "areal_prompt_tokens", "Prompt tokens sent to backends", registry=self.registry
        )
        self.completion_tokens = Counter(
            "areal_completion_tokens", "Tokens generated", registry=self.registry
        )
        self.in_flight = Gauge(
            "areal_in_flight_requests",
            "Requests being served",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.latency = Histogram(
            "areal_request_latency_seconds",
            "End-to-end latency",
            ["route"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.ttft = Histogram(
            "areal_time_to_first_token_seconds",
            "Streaming time to first token",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=self.registry,
        )
        self.capture_wait = Histogram(
            "areal_capture_wait_seconds",
            "Time waiting for the completion to be durable",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
            registry=self.registry,
        )
        self.resubmissions = Counter(
            "areal_resubmissions", "Aborted generations resubmitted", registry=self.registry
        )
        self._continuity_metrics()
        self._policy_metrics()
        # Labelled children, made once: prometheus_client's `labels()` takes a lock and
        # validates the values on every call (~1.5 µs; a completion made three calls).
        self._counted: dict[tuple[str, int], Any] = {}
        self._timed: dict[str, Any] = {}
        self._policy_children: dict[tuple[int | str, ...], Any] = {}

    def _continuity_metrics(self) -> None:
        self.continuity = Counter(
            "areal_token_continuity",
            "Prompts by how they were built: continued (an earlier completion's ids + the "
            "new messages' tokens), no_match (full render), or a full-render fallback "
            "(prefix_changed, not_prefix_stable, no_end_of_turn)",
            ["outcome"],
            registry=self.registry,
        )
        self.continuity_recalls = Counter(
            "areal_token_continuity_recalls",
            "Turns that looked in the store for the completion they extend (served by "
            "another gateway process, or before a restart): found or none",
            ["result"],
            registry=self.registry,
        )

    def _policy_metrics(self) -> None:
        """Per policy (`policy` = a policy name, `default` for the default policy): the
        label values are policy names the gateway checked (config, keys, sessions), so
        the cardinality is the number of policies. Off the request path: the syncer sets
        the version and observes swaps, the rewards route observes rewards."""
        self.policy_version = Gauge(
            "areal_policy_version",
            "The policy's adapter (weights) version this gateway serves",
            ["policy"],
            registry=self.registry,
            # Versions only grow; every worker adopts the same one (swapped or followed).
            multiprocess_mode="max",
        )
        self.policy_swap = Histogram(
            "areal_policy_swap_seconds",
            "Weight/adapter swap seconds per policy: per backend by phase (pause, update, "
            "continue, total) and the whole swap over every backend (swap)",
            ["policy", "phase"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self._swap_verify_metrics()
        self.policy_reward = Summary(
            "areal_policy_reward",
            "Rewards posted on the policy's sessions and completions (count and sum; a "
            "group reward counts once under each policy of the group's sessions)",
            ["policy"],
            registry=self.registry,
        )

    def _swap_verify_metrics(self) -> None:
        """Verified swaps (`gateway/swap_verify.py`), per policy and engine (`engine` = the
        engine's URL: as many values as the policy has engines)."""
        self.swap_verify = Histogram(
            "areal_swap_verify_seconds",
            "Seconds to score the swap canary on one engine after a swap",
            ["policy", "engine"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.swap_verify_diff = Gauge(
            "areal_swap_verify_max_abs_diff",
            "Largest |logprob difference| between the engine and the trainer's fingerprint "
            "at the last verified swap",
            ["policy", "engine"],
            registry=self.registry,
            multiprocess_mode="max",
        )
        self.swap_rollbacks = Counter(
            "areal_swap_rollbacks",
            "Swaps refused by the canary check and rolled back to the last verified version",
            ["policy", "engine"],
            registry=self.registry,
        )

    def observe_swap_verify(
        self, policy: str, engine: str, seconds: float, diff: float, rolled_back: bool
    ) -> None:
        """One engine's canary check of a swap of `policy` (the syncer, off the request
        path)."""
        self.swap_verify.labels(policy, engine).observe(seconds)
        self.swap_verify_diff.labels(policy, engine).set(diff)
        if rolled_back:
            self.swap_rollbacks.labels(policy, engine).inc()

    def count_request(self, route: str, status: int) -> None:
        """`requests{route, status}` + 1."""
        child = self._counted.get((route, status))
        if child is None:
            child = self._counted[route, status] = self.requests.labels(route, str(status))
        child.inc()

    def observe_latency(self, route: str, seconds: float) -> None:
        """`latency{route}` observes `seconds`."""
        child = self._timed.get(route)
        if child is None:
            child = self._timed[route] = self.latency.labels(route)
        child.observe(seconds)

    def _policy_child(self, metric: Gauge | Histogram | Summary, *labels: str) -> Any:
        """The cached child of `metric` for `labels` (made on first use)."""
        key: tuple[int | str, ...] = (id(metric), *labels)
        child = self._policy_children.get(key)
        if child is None:
            child = self._policy_children[key] = metric.labels(*labels)
        return child

    def set_policy_version(self, policy: str, version: int) -> None:
        """`policy_version{policy}` = `version` (the syncer, each poll)."""
        self._policy_child(self.policy_version, policy).set(version)

    def observe_swap(
        self, policy: str, per_backend: Mapping[str, Mapping[str, float]], swap_s: float
    ) -> None:
        """One swap of `policy`: each backend's `{pause_s, update_s, continue_s, total_s}`
        by phase, and the whole swap's `swap_s`."""
        for timings in per_backend.values():
            for phase in SWAP_PHASES:
                seconds = timings.get(f"{phase}_s")
                if seconds is not None:
                    self._policy_child(self.policy_swap, policy, phase).observe(seconds)
        self._policy_child(self.policy_swap, policy, "swap").observe(swap_s)

    def observe_reward(self, policy: str, value: float) -> None:
        """A reward posted on a session (or completion, group) of `policy`."""
        self._policy_child(self.policy_reward, policy).observe(value)

    def exposition(self) -> Collector:
        """What `/metrics` serves: this process's registry, or the sum over every
        worker's files in multiprocess mode (a fresh collector: it reads them per call)."""
        directory = os.environ.get(MULTIPROC_ENV)
        if not directory:
            return self.registry
        registry = CollectorRegistry()
        # ignore: prometheus_client leaves this constructor unannotated.
        MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
        return registry

    def totals(self, *names: str) -> dict[str, dict[tuple[str, ...], float]]:
        """Counters' `_total` by label values, over every worker, from one read of the
        metrics (in multiprocess mode a read opens every worker's files: blocking) (e.g.
        `totals("areal_requests")["areal_requests"][("chat", "200")]`)."""
        wanted = {f"{name}_total": name for name in names}
        out: dict[str, dict[tuple[str, ...], float]] = {name: {} for name in names}
        for family in self.exposition().collect():
            for sample in family.samples:
                name = wanted.get(sample.name)
                if name is not None:
                    key = tuple(sample.labels.values())
                    out[name][key] = out[name].get(key, 0.0) + sample.value
        return out


class _AuditCollector(Collector):
    def __init__(self, audit: EpisodeAudit) -> None:
        self._audit = audit

    def collect(self) -> Iterator[Metric]:
        states = GaugeMetricFamily("areal_episodes", "Sessions per state", labels=["state"])
        for state, n in self._audit.states.items():
            states.add_metric([state], n)
        yield states
        dropped = GaugeMetricFamily(
            "areal_episodes_dropped", "Dropped sessions by reason", labels=["reason"]
        )
        for reason, n in self._audit.dropped_by_reason.items():
            dropped.add_metric([reason], n)
        yield dropped
        yield GaugeMetricFamily(
            "areal_episodes_overdue",
            "Ended sessions claimable past every settling window (no trainer takes them)",
            value=self._audit.overdue,
        )
        yield GaugeMetricFamily(
            "areal_episodes_unaccounted",
            "Sessions no rule will ever move (must be 0)",
            value=self._audit.unaccounted,
        )


def audit_exposition(audit: EpisodeAudit) -> bytes:
    """The episode audit (`store/audit.py`) as Prometheus gauges, read from the store per
    scrape (the same numbers from every worker, so not kept in a worker's registry)."""
    registry = CollectorRegistry()
    registry.register(_AuditCollector(audit))
    return generate_latest(registry)
