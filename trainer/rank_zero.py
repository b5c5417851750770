"""What rank 0 alone holds: the store, the episode claimer and the claims it holds, the
metrics writer, and the weight broadcaster (`trainer.weight_sync: distributed`). The
other ranks get what they need from it by broadcast (`trainer/process.py`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

from areal_service.config import ServiceConfig
from areal_service.store import TrajectoryStore
from areal_service.store.claims import EpisodeClaimer
from areal_service.types import DEFAULT_POLICY, EpisodeGroup, TrainStepRecord
from trainer.metrics import MetricsWriter, batch_metrics, step_metrics
from trainer.model import DistInfo
from trainer.resume import recover_claims
from trainer.step import StepStats
from trainer.weight_broadcast import WeightBroadcaster

log = logging.getLogger(__name__)

RUN_NAME = "train"
"""`data_dir/runs/<RUN_NAME>`: TensorBoard events and the resolved config. Fixed, so a
resumed run appends to the same curves."""
POLICY_CHECK_S = 5.0
"""How often a waiting trainer of a runtime policy checks that its policy still exists."""


class HeldClaims:
    """Claims rank 0 holds: each is either marked trained or released on the way out."""

    def __init__(self, claimer: EpisodeClaimer) -> None:
        self._claimer = claimer
        self._ids: set[str] = set()

    def add(self, groups: Sequence[EpisodeGroup]) -> None:
        self._ids.update(g.claim_id for g in groups)

    def mark_trained(self, groups: Sequence[EpisodeGroup]) -> None:
        for group in groups:
            self._claimer.mark_trained(group.claim_id)
            self._ids.discard(group.claim_id)

    def release_all(self) -> None:
        for claim_id in sorted(self._ids):
            self._claimer.release_claim(claim_id)
        if self._ids:
            log.info("released %d unfinished claim(s)", len(self._ids))
        self._ids.clear()


class RankZero:
    """Rank 0's side of the run; `open` it on rank 0 only."""

    def __init__(
        self,
        store: TrajectoryStore,
        claimer: EpisodeClaimer,
        held: HeldClaims,
        writer: MetricsWriter,
        broadcaster: WeightBroadcaster | None,
        policy: str = DEFAULT_POLICY,
    ) -> None:
        self.store = store
        self.policy = policy
        """The policy this trainer trains (`trainer.policy`): its steps and versions."""
        self.claimer = claimer
        self.held = held
        self.writer = writer
        self.broadcaster = broadcaster
        self.runtime = policy != DEFAULT_POLICY and store.policies.has_policy(policy)
        """Whether its policy was created at runtime (stored), so it may be deleted."""
        self._checked_at = time.monotonic()

    @classmethod
    def open(cls, config: ServiceConfig, info: DistInfo, cleanup: contextlib.ExitStack) -> RankZero:
        """Open the store, finish what a killed trainer left (`recover_claims`), start the
        metrics run (and save the resolved config beside it), and the broadcaster when
        weights go by broadcast. `cleanup` unwinds in reverse: the broadcaster and writer
        close, held claims are released, then the store closes."""
        cfg = config.trainer
        store = TrajectoryStore.open(config.database_url(), config.store)
        cleanup.callback(store.close)
        claimer = EpisodeClaimer.from_config(store, cfg)
        recover_claims(store, claimer, cfg.policy)
        held = HeldClaims(claimer)
        cleanup.callback(held.release_all)  # a batch claimed but never published
        # One metrics run per policy: several trainers share the data directory.
        run_dir = (
            config.data_dir
            / "runs"
            / (RUN_NAME if cfg.policy == DEFAULT_POLICY else f"{RUN_NAME}-{cfg.policy}")
        )
        writer = MetricsWriter(
            run_dir, total_steps=cfg.total_steps, no_eos=cfg.no_eos, policy=cfg.policy
        )
        cleanup.callback(writer.close)
        (run_dir / "config.json").write_text(config.model_dump_json(indent=2))
        broadcaster = None
        if cfg.weight_sync == "distributed":
            broadcaster = WeightBroadcaster(
                store,
                backend="nccl" if info.device.type == "cuda" else "gloo",
                bucket_bytes=int(cfg.weight_sync_bucket_mb * 2**20),
                timeout_s=cfg.weight_sync_timeout_s,
                address=cfg.weight_sync_address,
            )
            cleanup.callback(broadcaster.close)
        return cls(store, claimer, held, writer, broadcaster, cfg.policy)

    def policy_deleted(self) -> bool:
        """Whether this trainer's runtime policy was deleted (`DELETE /admin/policies`):
        one primary-key read at most every `POLICY_CHECK_S`, only while it waits for
        episodes (a trainer the launcher started is stopped by it anyway; this is for
        those started by hand). Never for a config-declared policy."""
        if not self.runtime or time.monotonic() - self._checked_at < POLICY_CHECK_S:
            return False
        self._checked_at = time.monotonic()
        try:
            return not self.store.policies.has_policy(self.policy)
        except Exception:  # noqa: BLE001 - the store failed this once: ask again later
            log.warning("checking whether policy %s still exists failed", self.policy)
            return False

    def record_step(
        self,
        step: int,
        version: int,
        groups: Sequence[EpisodeGroup],
        advantages: Sequence[Sequence[float]],
        stats: StepStats,
        *,
        dropped: int,
        times: dict[str, float],
    ) -> None:
        """After `version` is published: its episodes are marked trained, and the step's
        metrics (`times`: the `time_*_s` of the step) go to the store and the writer."""
        self.held.mark_trained(groups)
        metrics = {
            **batch_metrics(groups, advantages, version=version - 1),
            **step_metrics(stats),
            "dropped_episodes": float(dropped),
            **self.claimer.settling_metrics(),
            **times,
            **_previous_swap(self.store, version, self.policy),
        }
        self.store.add_train_step(
            TrainStepRecord(step=step, version=version, metrics=metrics, policy=self.policy)
        )
        self.writer.write(step, version, metrics)


def _previous_swap(store: TrajectoryStore, version: int, policy: str) -> dict[str, float]:
    """`time_swap_s` of `policy`'s version - 1, once the gateway's syncer recorded it."""
    previous = store.get_weight_version(version - 1, policy)
    swap_s = previous.metadata.get("swap_s") if previous else None
    return {} if swap_s is None else {"time_swap_s": float(swap_s)}
