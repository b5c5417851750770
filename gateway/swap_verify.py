"""Verified swaps: after a version was swapped onto a pool's engines, and before it is
marked live, the swap canary is scored on each engine that took it and compared with
the fingerprint the trainer published with the version (`areal_service/canary.py`,
`trainer/canary.py`). A version any engine fails is refused: every engine that took it
goes back to the last verified version (so the pool keeps serving one version, the
verified one), the refusal and each engine's difference go on the version's row (where
the trainer reads them: repeated refusals stop it), and the metrics and the console show
it. Only that policy's pool or adapter is touched: another policy's swaps, versions and
requests are not.

Off the request path: it runs in the weight syncer's task, after the swap's continue.
Its cost is one scoring request per canary prompt per engine (`areal_swap_verify_seconds`).
Between continue and the verdict (the scoring time) the engine serves the new weights;
tokens generated then carry the new version's label, which is what computed them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from areal_service.canary import Fingerprint, max_abs_diff, tolerance
from areal_service.types import DEFAULT_POLICY, WeightVersionRecord
from gateway.backends import BackendError, SwapTimings
from gateway.routing import BackendPool, PoolMember
from gateway.state import GatewayState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineCheck:
    """One engine's canary score against the fingerprint."""

    max_abs_diff: float
    seconds: float
    error: str | None = None
    """Why the engine could not be scored (then the swap is refused on it)."""

    def passed(self, tol: float) -> bool:
        return self.error is None and self.max_abs_diff <= tol


@dataclass(frozen=True, slots=True)
class Verdict:
    """The checks of one swap, per engine URL."""

    checks: dict[str, EngineCheck]
    tolerance: float
    contrast: float | None

    @property
    def failed(self) -> list[str]:
        return [url for url, c in self.checks.items() if not c.passed(self.tolerance)]

    def metadata(self, rolled_back_to: int | None) -> dict[str, Any]:
        """What goes on the version's row under `verify` (JSON: an infinite difference,
        from an engine that scored other tokens, is written as None)."""
        return {
            "refused": bool(self.failed),
            "tolerance": self.tolerance,
            "contrast": self.contrast,
            "rolled_back_to": rolled_back_to,
            "engines": {
                url: {
                    "max_abs_diff": c.max_abs_diff if math.isfinite(c.max_abs_diff) else None,
                    "seconds": c.seconds,
                    "passed": c.passed(self.tolerance),
                    **({"error": c.error} if c.error else {}),
                }
                for url, c in self.checks.items()
            },
        }


def refused(record: WeightVersionRecord) -> bool:
    """Whether the gateway refused this version (never swapped to again)."""
    verdict = record.metadata.get("verify")
    return isinstance(verdict, dict) and bool(verdict.get("refused"))


async def score_engine(
    member: PoolMember, fingerprint: Fingerprint, adapter: str | None
) -> EngineCheck:
    """The canary on one engine: its largest difference from the fingerprint."""
    t0 = time.perf_counter()
    worst = 0.0
    try:
        for seq in fingerprint.sequences:
            got = await member.client.score_tokens(seq.ids, seq.start, lora_name=adapter)
            diff = max_abs_diff(seq.logprobs, got)
            worst = max(worst, diff if not math.isnan(diff) else math.inf)
    except (BackendError, NotImplementedError) as e:
        return EngineCheck(math.inf, time.perf_counter() - t0, f"{type(e).__name__}: {e}")
    return EngineCheck(worst, time.perf_counter() - t0)


async def verify(
    state: GatewayState,
    members: Iterable[PoolMember],
    record: WeightVersionRecord,
    lora_name: str | None,
) -> Verdict | None:
    """Score the canary on `members` (the engines that took `record`); None when there
    is nothing to check (verification off, or the row carries no fingerprint).
    `lora_name`: the swap's (`Backend.swap_weights`)."""
    cfg = state.config.swap_verify
    fingerprint = Fingerprint.from_metadata(record.metadata) if cfg.enabled else None
    if fingerprint is None:
        return None
    members = list(members)
    checks = await asyncio.gather(
        *(
            score_engine(m, fingerprint, m.client.canary_adapter(lora_name, record.version))
            for m in members
        )
    )
    tol = tolerance(cfg, fingerprint.dtype, state.config.engine.dtype)
    verdict = Verdict(
        {m.url: c for m, c in zip(members, checks, strict=True)}, tol, fingerprint.contrast()
    )
    failed = set(verdict.failed)
    for url, check in verdict.checks.items():
        state.metrics.observe_swap_verify(
            record.policy,
            url,
            check.seconds,
            check.max_abs_diff if math.isfinite(check.max_abs_diff) else 1e9,
            url in failed,
        )
    return verdict


def swap_fallback(
    state: GatewayState, pool: BackendPool, lora_name: str | None
) -> tuple[str, int] | None:
    """The last verified (live) version a refused swap goes back to: the pool's current
    target, or for a full swap before any, the checkpoint the engines started from."""
    if lora_name in (None, DEFAULT_POLICY):
        return pool.target or (str(state.config.model_dir().resolve()), 0)
    return pool.adapter_targets.get(lora_name)


async def swap_verified(
    state: GatewayState,
    pool: BackendPool,
    record: WeightVersionRecord,
    lora_name: str | None = None,
) -> dict[str, SwapTimings] | None:
    """`pool.swap_weights` to `record`, then the canary check; the timings when the
    version may go live, None when it was refused and rolled back (see the module)."""
    fallback = swap_fallback(state, pool, lora_name)
    timings = await pool.swap_weights(record.path, record.version, lora_name)
    return await settle(state, pool, record, timings, lora_name, fallback)


async def settle(
    state: GatewayState,
    pool: BackendPool,
    record: WeightVersionRecord,
    timings: dict[str, SwapTimings],
    lora_name: str | None,
    fallback: tuple[str, int] | None,
) -> dict[str, SwapTimings] | None:
    """The check of a swap that already happened (`timings`: the engines that took it);
    on a refusal the rollback to `fallback`. Returns `timings` or None (refused)."""
    took = [m for m in pool.backends if m.url in timings]
    verdict = await verify(state, took, record, lora_name)
    if verdict is None:
        return timings
    if not verdict.failed:
        await _record(state, record, verdict, None)
        return timings
    await _roll_back(pool, took, record, verdict, lora_name, fallback)
    await _record(state, record, verdict, fallback[1] if fallback else None)
    return None


async def _roll_back(
    pool: BackendPool,
    took: list[PoolMember],
    record: WeightVersionRecord,
    verdict: Verdict,
    lora_name: str | None,
    fallback: tuple[str, int] | None,
) -> None:
    """Every engine that took the refused version goes back to `fallback` (the pool
    keeps one version); one that cannot is taken out of rotation."""
    diffs = ", ".join(
        f"{url}: {verdict.checks[url].error or f'{verdict.checks[url].max_abs_diff:.3g}'}"
        for url in verdict.failed
    )
    log.error(
        "policy %s: v%d REFUSED by the swap canary (tolerance %.3g; %s); back to v%s",
        record.policy,
        record.version,
        verdict.tolerance,
        diffs,
        fallback[1] if fallback else "?",
    )
    for m in took:
        reason = f"refused v{record.version} and cannot go back"
        try:
            if fallback is None:
                raise BackendError(0, "no verified version to go back to")
            await m.client.swap_weights(fallback[0], fallback[1], lora_name)
        except BackendError as e:
            pool.mark_down(m, f"{reason}: {e.message}")
    if fallback is None:
        return
    if lora_name in (None, DEFAULT_POLICY):
        pool.target = fallback
    else:
        pool.adapter_targets[lora_name] = fallback


async def _record(
    state: GatewayState, record: WeightVersionRecord, verdict: Verdict, back_to: int | None
) -> None:
    await asyncio.to_thread(
        state.store.update_weight_version_metadata,
        record.version,
        {"verify": verdict.metadata(back_to)},
        record.policy,
    )
