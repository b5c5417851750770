"""Where a (re)started trainer continues: claims a killed trainer left are finished, and
steps and versions continue from the larger of the checkpoint's and the store's, so they
only ever increase (a restart from an older checkpoint never reuses a version number,
the AReaL#1388 failure mode)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from areal_service.lora_adapter import is_adapter_dir
from areal_service.store import TrajectoryStore
from areal_service.store.claims import EpisodeClaimer
from areal_service.types import DEFAULT_POLICY
from trainer.checkpoint import CheckpointState, load_published_weights
from trainer.lora import is_lora, load_adapter_weights
from trainer.process import broadcast_from_rank0

log = logging.getLogger(__name__)

RECOVER_VERSIONS = 8
"""Newest version rows whose recorded claims are re-marked trained at start."""


def resume(
    model: torch.nn.Module,
    store: TrajectoryStore | None,
    ckpt: CheckpointState | None,
    policy: str = DEFAULT_POLICY,
) -> tuple[int, int]:
    """Every rank: (last completed step, last published version) as rank 0 (the one
    with `store`) sees them; published weights newer than the checkpoint `ckpt` are
    loaded into `model` (updates published after the checkpoint are kept)."""
    step, version = broadcast_from_rank0(
        resume_point(store, ckpt, policy) if store is not None else None
    )
    newer = broadcast_from_rank0(
        newer_published_weights(store, ckpt, policy) if store is not None else None
    )
    if newer is not None:
        (load_adapter_weights if is_lora(model) else load_published_weights)(model, newer)
    return step, version


def recover_claims(
    store: TrajectoryStore, claimer: EpisodeClaimer, policy: str = DEFAULT_POLICY
) -> tuple[int, int]:
    """Finish what a killed trainer left: claims recorded in a published version row are
    marked trained (their update is live); every other claim is released so its episodes
    are trained once, by us. Returns (sessions marked trained, sessions released)."""
    marked = 0
    for record in store.list_weight_versions(limit=RECOVER_VERSIONS, policy=policy):
        for claim_id in record.metadata.get("episodes", {}):
            marked += claimer.mark_trained(claim_id)
    released = claimer.release_stale_claims(0)
    if marked or released:
        log.warning(
            "recovered claims of a previous trainer: %d session(s) marked trained "
            "(already published), %d released for training",
            marked,
            released,
        )
    return marked, released


def resume_point(
    store: TrajectoryStore, ckpt: CheckpointState | None, policy: str = DEFAULT_POLICY
) -> tuple[int, int]:
    """(last completed step, last published version) of `policy` to continue from: the
    larger of the checkpoint's and the store's, so steps and versions only ever
    increase."""
    latest = store.latest_weight_version(policy)
    version = max(ckpt.version if ckpt else 0, latest.version if latest else 0)
    step = max(
        ckpt.step if ckpt else 0,
        int(latest.metadata.get("step", 0)) if latest else 0,
        _last_train_step(store, policy),
    )
    return step, version


def newer_published_weights(
    store: TrajectoryStore, ckpt: CheckpointState | None, policy: str = DEFAULT_POLICY
) -> Path | None:
    """The published weights to continue from when the store is ahead of the checkpoint
    (the trainer died after publishing, before checkpointing): the model resumes from
    them, the optimizer from the checkpoint (its moments a few steps old). None when the
    checkpoint is current. If that directory is gone, the updates in between are lost
    to the model (their episodes stay trained, never retrained) and a warning says so."""
    latest = store.latest_weight_version(policy)
    held = ckpt.version if ckpt else 0
    if latest is None or latest.version <= held:
        return None
    path = Path(latest.path)
    if (path / "config.json").is_file() or is_adapter_dir(path):
        log.info(
            "store has published v%d past the checkpoint's v%d: resuming from %s",
            latest.version,
            held,
            path,
        )
        return path
    log.warning(
        "store has published v%d but the checkpoint holds v%d and %s is gone: the "
        "updates in between are lost to the model (their episodes are not "
        "retrained)",
        latest.version,
        held,
        path,
    )
    return None


def _last_train_step(store: TrajectoryStore, policy: str) -> int:
    last, page = 0, 1000
    while rows := store.list_train_steps(after_step=last, limit=page, policy=policy):
        last = rows[-1].step
    return last
