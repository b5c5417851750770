"""Trainer -> weights hop: writes policy version N as HF safetensors to `weights/v{N}/`
(temp dir + rename, via `model.save_hf_checkpoint`; with `default_policy.lora`, the adapter
alone, via `lora.save_adapter`), then records `WeightVersion(N)`.

The row is the commit point of a training step: it carries the step number and the
claims (with their session ids) whose episodes the version was trained on, so a
trainer killed before `mark_trained` can finish the job on restart (`recover_claims`
in train.py). The gateway's syncer only reads rows, so a `v{N}/` directory without a
row was never served and may be overwritten. Touches the store only on rank 0.

With a `WeightBroadcaster` (`trainer.weight_sync: distributed`) the order changes: the
row goes in first, carrying the broadcast offer, rank 0 broadcasts while the gateway
swaps, and the directory is written after (see `trainer/weight_broadcast.py`); a row
whose directory is not there yet is then normal for a moment.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_service.store import TrajectoryStore
from areal_service.types import DEFAULT_POLICY, WeightVersionRecord
from trainer.lora import is_lora, save_adapter
from trainer.model import full_state_dict, save_hf_checkpoint
from trainer.weight_broadcast import WeightBroadcaster

log = logging.getLogger(__name__)

KEEP_VERSIONS = 3
"""Published directories kept on disk (the newest ones). The syncer always swaps to the
latest row, so an older directory is only read by a swap that started before it was
superseded three times."""

_VERSION_DIR = re.compile(r"^v(\d+)$")
_TEMP_DIR = re.compile(r"^\.v\d+\.tmp-")


def version_dir(weights_dir: Path, version: int) -> Path:
    """Where version `version` is published."""
    return weights_dir / f"v{version}"


def publish_weights(
    model: torch.nn.Module,
    *,
    version: int,
    weights_dir: Path,
    tokenizer_dir: Path,
    store: TrajectoryStore | None,
    step: int,
    episodes: Mapping[str, Sequence[str]],
    keep: int = KEEP_VERSIONS,
    distributed: bool = False,
    broadcaster: WeightBroadcaster | None = None,
    tied_head_file: bool = False,
    policy: str = DEFAULT_POLICY,
    canary: Mapping[str, Any] | None = None,
) -> WeightVersionRecord:
    """Save `model` as `weights_dir/v{version}` and record the version. Collective (every
    rank calls it); `store` is used on rank 0 only (None elsewhere).

    `episodes` maps each claim id trained in this version to its session ids; it goes
    into the row's metadata with `step`. Returns the record (also on ranks that did not
    write it). Afterwards only the newest `keep` version directories remain.
    `distributed` (every rank, from the config): distributed sync first, by rank 0's
    `broadcaster` (None on the other ranks). `tied_head_file`: write a tied output head
    as a tensor too (vLLM backends; see `model.write_tied_head`). `canary`: the swap
    canary's fingerprint of these weights (`trainer/canary.py`), stored on the row
    (metadata `canary`) in the insert that publishes it.
    """
    extra = {} if canary is None else {"canary": dict(canary)}
    path = version_dir(weights_dir, version)
    if distributed:
        return _publish_broadcast(
            model,
            version=version,
            path=path,
            tokenizer_dir=tokenizer_dir,
            store=store,
            step=step,
            episodes=episodes,
            keep=keep,
            broadcaster=broadcaster,
            extra=extra,
        )
    # overwrite: a directory without a row is left over by a trainer that died between
    # the rename and the insert; nobody was told about it.
    if is_lora(model):  # the adapter alone (a few MB); the backends keep the base
        save_adapter(model, path, overwrite=True)
    else:
        save_hf_checkpoint(
            model, tokenizer_dir, path, overwrite=True, tied_head_file=tied_head_file
        )
    record = WeightVersionRecord(
        version=version,
        path=str(path.resolve()),
        metadata={
            "step": step,
            "episodes": {c: list(s) for c, s in episodes.items()},
            **extra,
        },
        policy=policy,
    )
    if dist.get_rank() == 0:
        assert store is not None, "rank 0 publishes the version row"
        store.add_weight_version(record)
        prune_versions(weights_dir, keep=keep, protect=_live_dir(store, policy))
        log.info("published weights v%d (step %d) at %s", version, step, path)
    return record


def _publish_broadcast(
    model: torch.nn.Module,
    *,
    version: int,
    path: Path,
    tokenizer_dir: Path,
    store: TrajectoryStore | None,
    step: int,
    episodes: Mapping[str, Sequence[str]],
    keep: int,
    broadcaster: WeightBroadcaster | None,
    extra: Mapping[str, Any],
) -> WeightVersionRecord:
    """Distributed publish: gather once; rank 0 inserts the row with the offer and
    broadcasts while the gateway swaps, then the directory is written from the same
    gathered state. The row's metadata also gets the broadcast's outcome."""
    state = full_state_dict(model)
    metadata: dict[str, object] = {
        "step": step,
        "episodes": {c: list(s) for c, s in episodes.items()},
        **extra,
    }
    if dist.get_rank() == 0:
        assert store is not None and broadcaster is not None, "rank 0 broadcasts"
        offer, buckets = broadcaster.offer(version, state)
        record = WeightVersionRecord(
            version=version, path=str(path.resolve()), metadata={**metadata, "sync": offer}
        )
        store.add_weight_version(record)
        metadata.update(broadcaster.send(version, state, offer, buckets))
    save_hf_checkpoint(model, tokenizer_dir, path, overwrite=True, state=state)
    if dist.get_rank() == 0:
        prune_versions(path.parent, keep=keep)
        log.info("published weights v%d (step %d) by broadcast, copy at %s", version, step, path)
    return WeightVersionRecord(version=version, path=str(path.resolve()), metadata=metadata)


def _live_dir(store: TrajectoryStore, policy: str) -> Path | None:
    """The directory of `policy`'s live version: what a swap the canary refuses goes
    back to (`gateway/swap_verify.py`), so it outlives `keep` newer versions."""
    live = store.live_weight_version(policy=policy)
    return Path(live.path) if live is not None else None


def prune_versions(
    weights_dir: Path, *, keep: int = KEEP_VERSIONS, protect: Path | None = None
) -> list[Path]:
    """Delete every `v{N}` directory but the newest `keep` (and `protect`), and temp
    directories of interrupted saves; returns what was deleted. Call on one rank only."""
    if not weights_dir.is_dir():
        return []
    versions = sorted(
        (int(m.group(1)), p)
        for p in weights_dir.iterdir()
        if p.is_dir() and (m := _VERSION_DIR.match(p.name))
    )
    kept = protect.resolve() if protect is not None else None
    doomed = [p for _, p in versions[: max(len(versions) - keep, 0)] if p.resolve() != kept]
    doomed += [p for p in weights_dir.iterdir() if p.is_dir() and _TEMP_DIR.match(p.name)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed
