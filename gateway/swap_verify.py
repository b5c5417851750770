"""Verified swaps: after a version was swapped onto a pool's engines, and before it is
marked live, the swap canary is scored on each engine that took it and compared with
the fingerprint the trainer published with the version (`areal_service/canary.py`,
`trainer/canary.py`). A version any engine fails is refused: every engine that took it
goes back to the last verified version (so the pool keeps serving one version, the
verified one), the refusal and each engine's difference go on the version's row (where
the trainer reads them: repeated refusals stop it), and the metrics and the console show
it. Only that policy's pool or adapter is touched: another policy's swaps, versions and
requests are not.

Where the check runs, so that no request sees a refused version where the engine allows:
- the local engine scores while paused, so a full swap is checked between the load and
  continue, and a refusal reloads the verified version before continue
  (`Backend.swap_weights`): nothing is ever generated under it;
- a versioned adapter (vLLM, SGLang with LoRA) is scored under its new name before the
  policy's requests are switched to it (`Backend.swap_adapter`): a refused name is never
  switched to;
- otherwise (full weights on vLLM or SGLang, which queue requests while paused; the local
  engine's in-place adapters) right after the swap, by `settle`: for the scoring time
  the engine serves the new weights, and tokens generated then carry the new version's
  label, which is what computed them.

Off the request path: it runs in the weight syncer's task. Its cost is the canary's
prefill on each engine (one request on vLLM, one per prompt elsewhere, sent together;
`areal_swap_verify_seconds`).
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
from gateway.backends import Backend, BackendError, SwapTimings
from gateway.routing import BackendPool, PoolMember
from gateway.state import GatewayState

log = logging.getLogger(__name__)
_NO_SCORE = 1e9
"""`areal_swap_verify_max_abs_diff` of an engine that could not be scored (or scored
other tokens): a gauge cannot hold infinity in every exposition format."""


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
    backend: Backend, fingerprint: Fingerprint, adapter: str | None
) -> EngineCheck:
    """The canary on one engine: its largest difference from the fingerprint."""
    t0 = time.perf_counter()
    try:
        # together: one request on vLLM, concurrent ones elsewhere (one batch step)
        scored = await backend.score_canary(
            [(seq.ids, seq.start) for seq in fingerprint.sequences], lora_name=adapter
        )
    except (BackendError, NotImplementedError) as e:
        return EngineCheck(math.inf, time.perf_counter() - t0, f"{type(e).__name__}: {e}")
    diffs = [
        max_abs_diff(s.logprobs, got) for s, got in zip(fingerprint.sequences, scored, strict=True)
    ]
    worst = max(math.inf if math.isnan(d) else d for d in diffs)
    return EngineCheck(worst, time.perf_counter() - t0)


class CanaryCheck:
    """One swap's check (a `SwapCheck`): each engine's verdict by its client's URL, run
    by the engine's swap where it can refuse unseen (`Backend.swap_weights`), else by
    `settle` after the swap."""

    def __init__(
        self,
        fingerprint: Fingerprint,
        tol: float,
        fallback: tuple[str, int] | None,
        lora_name: str | None,
        version: int,
    ) -> None:
        self.fingerprint, self.tolerance, self.fallback = fingerprint, tol, fallback
        self.lora_name, self.version = lora_name, version
        self.checks: dict[str, EngineCheck] = {}
        self.back: set[str] = set()
        """Engines that refused and already serve the verified version again."""

    async def __call__(self, backend: Backend, adapter: str | None) -> bool:
        check = await score_engine(backend, self.fingerprint, adapter)
        self.checks[backend.base_url] = check
        return check.passed(self.tolerance)

    def refused(self, backend: Backend) -> None:
        self.back.add(backend.base_url)

    async def after_swap(self, members: Iterable[PoolMember]) -> None:
        """Score the engines the swap did not check itself."""
        todo = [m for m in members if m.client.base_url not in self.checks]
        await asyncio.gather(
            *(self(m.client, m.client.canary_adapter(self.lora_name, self.version)) for m in todo)
        )

    def verdict(self, members: Iterable[PoolMember]) -> Verdict:
        return Verdict(
            {
                m.url: self.checks[m.client.base_url]
                for m in members
                if m.client.base_url in self.checks
            },
            self.tolerance,
            self.fingerprint.contrast(),
        )


def swap_fallback(
    state: GatewayState, pool: BackendPool, lora_name: str | None
) -> tuple[str, int] | None:
    """The last verified (live) version a refused swap goes back to: the pool's current
    target, or for a full swap before any, the checkpoint the engines started from."""
    if lora_name in (None, DEFAULT_POLICY):
        return pool.target or (str(state.config.model_dir().resolve()), 0)
    return pool.adapter_targets.get(lora_name)


def canary_check(
    state: GatewayState,
    record: WeightVersionRecord,
    lora_name: str | None,
    fallback: tuple[str, int] | None,
) -> CanaryCheck | None:
    """The check of a swap to `record`; None when there is nothing to check
    (verification off, or the row carries no fingerprint)."""
    cfg = state.config.swap_verify
    fingerprint = Fingerprint.from_metadata(record.metadata) if cfg.enabled else None
    if fingerprint is None:
        return None
    tol = tolerance(cfg, fingerprint.dtype, state.config.engine.dtype)
    return CanaryCheck(fingerprint, tol, fallback, lora_name, record.version)


async def swap_verified(
    state: GatewayState,
    pool: BackendPool,
    record: WeightVersionRecord,
    lora_name: str | None = None,
) -> dict[str, SwapTimings] | None:
    """`pool.swap_weights` to `record` with the canary check; the timings when the
    version may go live, None when it was refused and rolled back (see the module)."""
    check = canary_check(state, record, lora_name, swap_fallback(state, pool, lora_name))
    timings = await pool.swap_weights(record.path, record.version, lora_name, check)
    return await settle(state, pool, record, timings, check)


async def settle(
    state: GatewayState,
    pool: BackendPool,
    record: WeightVersionRecord,
    timings: dict[str, SwapTimings],
    check: CanaryCheck | None,
) -> dict[str, SwapTimings] | None:
    """The verdict of a swap that already happened (`timings`: the engines that took
    it): the engines the swap did not check are scored now; on a refusal every engine
    that took it goes back to the verified version. `timings`, or None (refused)."""
    if check is None:
        return timings
    took = [m for m in pool.backends if m.url in timings]
    await check.after_swap(took)
    verdict = check.verdict(took)
    failed = set(verdict.failed)
    for url, c in verdict.checks.items():
        diff = c.max_abs_diff if math.isfinite(c.max_abs_diff) else _NO_SCORE
        state.metrics.observe_swap_verify(record.policy, url, c.seconds, diff, url in failed)
    if failed:
        await _roll_back(pool, took, record, verdict, check)
    fallback = check.fallback
    await _record(state, record, verdict, fallback[1] if failed and fallback else None)
    return None if failed else timings


async def _roll_back(
    pool: BackendPool,
    took: list[PoolMember],
    record: WeightVersionRecord,
    verdict: Verdict,
    check: CanaryCheck,
) -> None:
    """Every engine that took the refused version and is not back yet goes back to the
    verified one (the pool keeps serving one version); one that cannot is taken out of
    rotation."""
    fallback, lora_name = check.fallback, check.lora_name
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
        if m.client.base_url in check.back:
            continue
        try:
            if fallback is None:
                raise BackendError(0, "no verified version to go back to")
            await m.client.swap_weights(fallback[0], fallback[1], lora_name)
        except BackendError as e:
            pool.mark_down(m, f"refused v{record.version} and cannot go back: {e.message}")
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
