"""Data shaping for the console's list pages: overview figures, the sessions table,
training-step series and weight-version rows. Reads the store and the gateway state
only (never writes); the session detail page lives in `detail.py`. Every function here
is synchronous and may hit the database: routes call them through `asyncio.to_thread`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from areal_service.store import TrajectoryStore
from areal_service.store.audit import EpisodeAudit
from areal_service.store.merge_stats import MergeStats
from areal_service.store.readiness import SettlingCounts
from areal_service.store.session_queries import SessionQuery, SessionSummary
from areal_service.types import DEFAULT_POLICY, SessionStatus, TrainStepRecord
from gateway.admission import window
from gateway.routing import BackendStatus
from gateway.state import GatewayState

SESSION_STATUSES: tuple[SessionStatus, ...] = ("open", "ended", "claimed", "trained", "dropped")
PAGE_SIZE = 50

TRAIN_METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Task reward", ("task_reward",)),
    ("Loss", ("loss",)),
    ("Approx. KL", ("approx_kl",)),
    ("Clip ratio", ("clip_ratio",)),
    ("Importance weight", ("importance_weight",)),
    ("Train-inference mismatch", ("mismatch_kl", "mismatch_masked_ratio")),
    ("Truncated (no EOS)", ("no_eos_ratio",)),
    ("Entropy", ("entropy",)),
    ("Staleness", ("staleness_mean", "staleness_max")),
    ("Avg. sequence length", ("avg_seq_len",)),
    ("Tokens / s", ("tokens_per_s",)),
)
"""Charts of the training page: (title, metric keys drawn on it). Every `time_*_s`
metric found in the steps is drawn on one extra "Step time" chart."""


# Overview.


@dataclass(frozen=True, slots=True)
class Rates:
    """Requests and generated tokens per second over the last sampling interval."""

    requests_per_s: float
    tokens_per_s: float
    interval_s: float
    requests_total: float
    tokens_total: float


@dataclass(frozen=True, slots=True)
class Overview:
    """Everything the overview page shows."""

    model: str
    live_version: int
    backends: list[BackendStatus]
    open_sessions: int
    started_sessions: int
    admitted_sessions: int
    """Sessions holding a place in the staleness window (not dropped)."""
    staleness_window: int
    staleness_gate: bool
    last_step: TrainStepRecord | None
    settling: SettlingCounts
    audit: EpisodeAudit
    """Every session's state, the dropped by reason, unaccounted (`store/audit.py`)."""
    reward_wait_s: float
    unrewarded_policy: str
    rates: Rates
    uptime_s: float
    merge: MergeStats | None = None
    """How recent sessions merge into training sequences (token continuity's effect)."""
    continuity: dict[str, float] = field(default_factory=dict)
    """This gateway's `areal_token_continuity` counts by outcome."""


OVERVIEW_COUNTERS = ("areal_requests", "areal_completion_tokens", "areal_token_continuity")
"""The counters the overview reads (one `GatewayMetrics.totals` read, every worker)."""


def sample_rates(
    state: GatewayState, last: dict[str, float], totals: dict[str, dict[tuple[str, ...], float]]
) -> Rates:
    """Rates since the previous call (`last` is that call's sample, updated in place;
    one per app). The first call, or one after a long gap, averages since start."""
    now = time.time()
    requests = sum(totals["areal_requests"].values())
    tokens = sum(totals["areal_completion_tokens"].values())
    if last and 0.5 <= now - last["t"] <= 300:
        base = last
    else:
        base = {"t": state.started_at or now, "requests": 0.0, "tokens": 0.0}
    interval = max(now - base["t"], 1e-9)
    last.update(t=now, requests=requests, tokens=tokens)
    return Rates(
        (requests - base["requests"]) / interval,
        (tokens - base["tokens"]) / interval,
        interval,
        requests,
        tokens,
    )


def overview(state: GatewayState, last: dict[str, float]) -> Overview:
    """The overview figures (a few small queries and one read of the metrics; blocking):
    `last` is `sample_rates`'s previous sample."""
    totals = state.metrics.totals(*OVERVIEW_COUNTERS)
    rates = sample_rates(state, last, totals)
    store, trainer = state.store, state.config.trainer
    return Overview(
        model=state.config.gateway.model_name,
        live_version=state.live_version,
        backends=state.backends.status(),
        open_sessions=store.count_sessions(status="open"),
        started_sessions=store.count_sessions(),
        admitted_sessions=store.count_admitted_sessions(),
        staleness_window=window(state, state.live_version),
        staleness_gate=state.config.gateway.sessions.staleness_gate,
        last_step=store.latest_train_step(),
        settling=store.settling_counts(),
        audit=store.episode_audit(trainer),
        reward_wait_s=trainer.reward_wait_s,
        unrewarded_policy=trainer.unrewarded_policy,
        rates=rates,
        uptime_s=time.time() - state.started_at if state.started_at else 0.0,
        merge=store.merge_stats(),
        continuity={labels[0]: n for labels, n in totals["areal_token_continuity"].items()},
    )


# Sessions table.


@dataclass(frozen=True, slots=True)
class SessionFilters:
    """The sessions page's query string (empty strings mean "any")."""

    status: str = ""
    group_id: str = ""
    task_id: str = ""
    key_id: str = ""
    since: str = ""
    """Created on or after this UTC date (YYYY-MM-DD)."""
    until: str = ""
    """Created before the end of this UTC date (YYYY-MM-DD)."""
    page: int = 1

    def query(self, **changes: Any) -> str:
        """This filter as a query string, with `changes` applied (for pager links)."""
        values = {
            "status": self.status,
            "group_id": self.group_id,
            "task_id": self.task_id,
            "key_id": self.key_id,
            "since": self.since,
            "until": self.until,
            "page": self.page,
            **changes,
        }
        return urlencode({k: v for k, v in values.items() if v not in ("", None, 1)})


SessionRowView = SessionSummary
"""One line of the sessions table (the store's summary: session, turns, tokens, reward)."""


@dataclass(frozen=True, slots=True)
class SessionPage:
    """One page of the sessions table."""

    rows: list[SessionRowView]
    total: int
    filters: SessionFilters
    pages: int = field(default=1)


MAX_PAGE = 10_000_000
"""Pages beyond are the last one asked for (empty): an offset stays a 64-bit integer."""


def utc_day_start(day: str) -> float:
    """Epoch seconds of 00:00 UTC on `day` (YYYY-MM-DD); ValueError if malformed."""
    return datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=UTC).timestamp()


def _query(filters: SessionFilters) -> SessionQuery:
    until = utc_day_start(filters.until) + 86400 if filters.until else None
    return SessionQuery(
        statuses=(filters.status,) if filters.status else None,  # type: ignore[arg-type]
        group_id=filters.group_id or None,
        task_id=filters.task_id or None,
        api_key_id=filters.key_id or None,
        created_from=utc_day_start(filters.since) if filters.since else None,
        created_before=until,
    )


def sessions_page(store: TrajectoryStore, filters: SessionFilters) -> SessionPage:
    """Newest first, PAGE_SIZE a page; turn counts and rewards in one query each."""
    offset = (min(max(filters.page, 1), MAX_PAGE) - 1) * PAGE_SIZE  # 64-bit in SQL
    total, rows = store.session_summaries(_query(filters), limit=PAGE_SIZE, offset=offset)
    return SessionPage(rows, total, filters, pages=max(math.ceil(total / PAGE_SIZE), 1))


# Training and weights.


def train_series(steps: list[TrainStepRecord]) -> dict[str, Any]:
    """Chart data for the training page: {"steps": [...], "charts": [{"title", "series":
    [{"name", "values"}]}]}; a metric absent from a step is null (a gap in the line)."""
    xs = [s.step for s in steps]
    keys = sorted({k for s in steps for k in s.metrics})
    charts = list(TRAIN_METRICS)
    timings = tuple(k for k in keys if k.startswith("time_") and k.endswith("_s"))
    if timings:
        charts.append(("Step time (s)", timings))

    def values(key: str) -> list[float | None]:
        out = [s.metrics.get(key) for s in steps]
        return [v if v is not None and math.isfinite(v) else None for v in out]

    return {
        "steps": xs,
        "charts": [
            {"title": title, "series": [{"name": k, "values": values(k)} for k in names]}
            for title, names in charts
            if any(k in keys for k in names)
        ],
    }


@dataclass(frozen=True, slots=True)
class WeightRow:
    """One published weight version with the swap timings the gateway recorded."""

    version: int
    path: str
    created_at: float
    step: int | None
    episodes: int
    swap: dict[str, dict[str, float]]
    swap_s: float | None
    publish_to_live_s: float | None
    live_at: float | None
    verify: dict[str, Any] | None = None
    """The swap canary's verdict (`gateway/swap_verify.py`): `refused`, `tolerance`,
    `rolled_back_to`, per engine `max_abs_diff`; None when the version was not checked."""


def weight_rows(
    store: TrajectoryStore, limit: int = 200, policy: str = DEFAULT_POLICY
) -> list[WeightRow]:
    """`policy`'s versions, newest first; `episodes` counts the sessions the version was
    trained on."""
    rows = []
    for w in store.list_weight_versions(limit=limit, policy=policy):
        meta = w.metadata
        groups = meta.get("episodes") or {}
        rows.append(
            WeightRow(
                version=w.version,
                path=w.path,
                created_at=w.created_at,
                step=meta.get("step"),
                episodes=sum(len(v) for v in groups.values()) if isinstance(groups, dict) else 0,
                swap=meta.get("swap") or {},
                swap_s=meta.get("swap_s"),
                publish_to_live_s=meta.get("publish_to_live_s"),
                live_at=meta.get("live_at"),
                verify=meta.get("verify") if isinstance(meta.get("verify"), dict) else None,
            )
        )
    return rows
