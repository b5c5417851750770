"""Resumable trainer checkpoints: full model state dict, full optimizer state (gathered
from the FSDP2 shards with `torch.distributed.checkpoint.state_dict`), every rank's
python/torch RNG state, step and policy version.

Layout: `checkpoint_dir/step-{N}/{model.pt, optim.pt, rng.pt, meta.json}`, written by
rank 0 into a temp dir and renamed (a `step-{N}` directory is always complete), then
`checkpoint_dir/latest` (text: the directory name) is replaced atomically. Restoring
reads `latest` on rank 0 and broadcasts tensors to the shards. Touches no store; which
episodes were trained is recorded in the store, never here.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from areal_service.atomic import atomic_dir

log = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 2
"""Checkpoints kept on disk (the newest). Each holds the model plus two AdamW moments
(about 3x the fp32 parameter bytes)."""

_STEP_DIR = re.compile(r"^step-(\d+)$")
_SAVE_OPTIONS = StateDictOptions(full_state_dict=True, cpu_offload=True)
_LOAD_OPTIONS = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


@dataclass(frozen=True)
class CheckpointState:
    """What a restored checkpoint says about the run."""

    step: int
    """Training steps completed."""
    version: int
    """Policy version of the model weights in the checkpoint."""
    path: Path


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    checkpoint_dir: Path,
    step: int,
    version: int,
    keep: int = KEEP_CHECKPOINTS,
) -> Path:
    """Write `checkpoint_dir/step-{step}` and point `latest` at it; keep the newest `keep`.
    Collective (every rank calls it). Peak host memory on rank 0: model + optimizer, full."""
    model_state = get_model_state_dict(model, options=_SAVE_OPTIONS)
    optim_state = get_optimizer_state_dict(model, optimizer, options=_SAVE_OPTIONS)
    rng_states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rng_states, _rng_state())
    out = checkpoint_dir / f"step-{step}"
    if dist.get_rank() == 0:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        with atomic_dir(out) as tmp:
            torch.save(model_state, tmp / "model.pt")
            torch.save(optim_state, tmp / "optim.pt")
            torch.save(rng_states, tmp / "rng.pt")
            (tmp / "meta.json").write_text(json.dumps({"step": step, "version": version}))
        _write_latest(checkpoint_dir, out.name)
        _prune(checkpoint_dir, keep)
        log.info("checkpoint step %d (v%d) saved to %s", step, version, out)
    dist.barrier()
    return out


def _write_latest(checkpoint_dir: Path, name: str) -> None:
    pointer = checkpoint_dir / "latest"
    tmp = pointer.with_name(".latest.tmp")
    tmp.write_text(name)
    os.replace(tmp, pointer)


def _prune(checkpoint_dir: Path, keep: int) -> None:
    steps = sorted(
        (int(m.group(1)), p)
        for p in checkpoint_dir.iterdir()
        if p.is_dir() and (m := _STEP_DIR.match(p.name))
    )
    for _, path in steps[: max(len(steps) - keep, 0)]:
        shutil.rmtree(path, ignore_errors=True)
    for path in checkpoint_dir.glob(".step-*.tmp-*"):  # interrupted saves
        shutil.rmtree(path, ignore_errors=True)


def load_published_weights(model: torch.nn.Module, path: Path) -> None:
    """Load the HF safetensors published at `path` (a `weights/vN` directory) into
    `model`, sharded or not. Collective: rank 0 reads the files and broadcasts. Not
    strict: a tied `lm_head.weight` that `save_pretrained` left out keeps its tie."""
    state: dict[str, Any] = {}
    if dist.get_rank() == 0:
        for file in sorted(path.glob("*.safetensors")):
            state.update(load_file(file))
        if not state:
            raise FileNotFoundError(f"no *.safetensors under {path}")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, state, options=options)
    log.info("loaded published weights from %s", path)


def latest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The directory `latest` names, or None when there is no checkpoint yet."""
    pointer = checkpoint_dir / "latest"
    if not pointer.is_file():
        return None
    path = checkpoint_dir / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"{pointer} names {path}, which is not a complete checkpoint")
    return path


def restore_checkpoint(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: Path
) -> CheckpointState | None:
    """Load the latest checkpoint into `model` (sharded or not) and `optimizer`, and
    restore this rank's RNG state; None (nothing changed) when there is none. Collective:
    rank 0 reads the files and broadcasts; the other ranks need not see the directory."""
    found: list[Any] = [None]
    if dist.get_rank() == 0:
        path = latest_checkpoint(checkpoint_dir)
        if path is not None:
            found[0] = (path, json.loads((path / "meta.json").read_text()))
    dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        return None
    path, meta = found[0]
    model_state: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    rng_states: list[Any] = [None]
    if dist.get_rank() == 0:
        model_state = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
        optim_state = torch.load(path / "optim.pt", map_location="cpu", weights_only=True)
        rng_states = torch.load(path / "rng.pt", weights_only=True)
    set_model_state_dict(model, model_state, options=_LOAD_OPTIONS)
    set_optimizer_state_dict(model, optimizer, optim_state, options=_LOAD_OPTIONS)
    holder = [rng_states]
    dist.broadcast_object_list(holder, src=0)
    rng_states = holder[0]
    # A different world size than at save time reuses the saved states round-robin.
    _set_rng_state(rng_states[dist.get_rank() % len(rng_states)])
    state = CheckpointState(step=int(meta["step"]), version=int(meta["version"]), path=path)
    log.info("restored checkpoint step %d (v%d) from %s", state.step, state.version, path)
    return state
