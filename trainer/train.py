"""The trainer's main loop (`areal-service trainer`, or `torchrun -m trainer.train`): claim
finished, rewarded episode groups from the store, train one decoupled-PPO step on them,
publish the new policy version to the weights directory, mark the episodes trained,
record metrics, checkpoint. Talks only to the store and the weights directory; the
gateway's weight syncer swaps the backends when it sees the new version row.

Versions: the initial model is v0 (what the backends start with). Every step publishes
exactly one version, always above every version the store has seen, so a restart from
an older checkpoint never reuses a version number (the AReaL#1388 failure mode).
Exactly-once training: a step commits when its version row (which lists the step's
claims) is written; sessions are marked trained right after. On start, claims listed
in recent version rows are marked trained and every other claim is released, which
assumes ONE trainer per store (a second trainer's live claims would be released too).
Distributed: rank 0 alone talks to the store; it broadcasts the batch, every rank
trains the same number of micro-batches, and rank 0's stop decision is broadcast.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers.utils import logging as hf_logging

from areal_service.config import ServiceConfig, TrainerConfig, load_config
from areal_service.lora_adapter import is_adapter_dir
from areal_service.store import TrajectoryStore
from areal_service.store.claims import EpisodeClaimer
from areal_service.types import EpisodeGroup, TrainSequence, TrainStepRecord
from trainer.advantage import RunningBaseline, sequence_advantages
from trainer.batch import MicroBatch, build_micro_batches
from trainer.checkpoint import (
    CheckpointState,
    load_published_weights,
    restore_checkpoint,
    save_checkpoint,
)
from trainer.lora import is_lora, load_adapter_weights, wrap_lora
from trainer.metrics import MetricsWriter, batch_metrics, step_metrics
from trainer.model import (
    DistInfo,
    apply_fsdp2,
    destroy_distributed,
    init_distributed,
    load_policy,
    load_reference,
    resolve_dtype,
)
from trainer.publish import publish_weights
from trainer.step import build_optimizer, train_step
from trainer.truncation import apply_no_eos
from trainer.weight_broadcast import WeightBroadcaster

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05
"""How often rank 0 asks the claimer for ready groups while a batch fills up."""
HEARTBEAT_S = 60.0
"""Longest the other ranks wait in one broadcast while rank 0 waits for episodes (well
under the NCCL/gloo collective timeouts, so an idle online trainer never times out)."""
RECOVER_VERSIONS = 8
"""Newest version rows whose recorded claims are re-marked trained at start."""
RUN_NAME = "train"
"""`data_dir/runs/<RUN_NAME>`: TensorBoard events and the resolved config. Fixed, so a
resumed run appends to the same curves."""


def main(config: ServiceConfig, *, stop: threading.Event | None = None) -> None:
    """Train until `trainer.total_steps` (None: until SIGTERM/SIGINT or `stop` is set)."""
    cfg = config.trainer
    stop = stop or threading.Event()
    with contextlib.ExitStack() as cleanup:  # unwinds in reverse: claims before the store
        if not dist.is_initialized():
            cleanup.callback(destroy_distributed)
        info = init_distributed()
        cleanup.callback(_install_signal_handlers(stop))
        hf_logging.disable_progress_bar()  # per-load/save tqdm bars only clutter the log
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        random.seed(cfg.seed + info.rank)
        torch.manual_seed(cfg.seed + info.rank)
        model_dir = _prepare_model_dir(config, info)
        model = load_policy(model_dir)
        if cfg.lora is not None:  # frozen base + trainable adapter, same step code
            model = wrap_lora(model, cfg.lora, seed=cfg.seed)  # one init on every rank
        eos_ids = eos_token_ids(model)
        bf16 = resolve_dtype(cfg.dtype, info.device.type) == torch.bfloat16
        model = apply_fsdp2(model, mixed_precision=bf16)
        ref_model = reference_model(cfg, model_dir, mixed_precision=bf16)
        optimizer = build_optimizer(model, cfg)
        ckpt = restore_checkpoint(model, optimizer, config.checkpoint_dir())
        store = claimer = held = writer = broadcaster = None
        if info.rank == 0:
            store = TrajectoryStore.open(config.database_url(), config.store)
            cleanup.callback(store.close)
            claimer = EpisodeClaimer.from_config(store, cfg)
            recover_claims(store, claimer)
            held = HeldClaims(claimer)
            cleanup.callback(held.release_all)  # a batch claimed but never published
            run_dir = config.data_dir / "runs" / RUN_NAME
            writer = MetricsWriter(run_dir, total_steps=cfg.total_steps, no_eos=cfg.no_eos)
            cleanup.callback(writer.close)
            (run_dir / "config.json").write_text(config.model_dump_json(indent=2))
            if cfg.weight_sync == "distributed":
                broadcaster = WeightBroadcaster(
                    store, backend="nccl" if info.device.type == "cuda" else "gloo",
                    bucket_bytes=int(cfg.weight_sync_bucket_mb * 2**20),
                    timeout_s=cfg.weight_sync_timeout_s, address=cfg.weight_sync_address)
                cleanup.callback(broadcaster.close)
        step, version = _broadcast(resume_point(store, ckpt) if info.rank == 0 else None)
        newer = _broadcast(newer_published_weights(store, ckpt) if info.rank == 0 else None)
        if newer is not None:  # updates published after the checkpoint are kept
            (load_adapter_weights if is_lora(model) else load_published_weights)(model, newer)
        saved_step = step  # nothing to checkpoint until this process trains
        baseline = (RunningBaseline(cfg.baseline_decay)
                    if cfg.ungrouped_baseline == "task_mean" else None)
        log.info("trainer starts after step %d at policy v%d", step, version)

        while cfg.total_steps is None or step < cfg.total_steps:
            groups, dropped, wait_s = next_batch(claimer, held, cfg, version, stop, info)
            if groups is None:
                break  # stopped while waiting; `held` releases the partial batch
            shaped = apply_no_eos(groups, cfg, eos_ids)
            advantages = sequence_advantages(shaped, cfg.advantage, cfg.adv_eps, baseline)
            micro_batches = shard_micro_batches(shaped, advantages, cfg.max_tokens_per_mb, info)
            t0, cpu0 = time.perf_counter(), time.process_time()
            stats = train_step(model, optimizer, micro_batches, cfg, ref_model=ref_model)
            train_s, train_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
            # A stop signal during training lets the step finish: publishing keeps its
            # work, and the next batch wait sees `stop` and ends the loop.
            step, version = step + 1, version + 1
            t0 = time.perf_counter()
            publish_weights(
                model,
                version=version,
                weights_dir=config.weights_dir(),
                tokenizer_dir=Path(config.gateway.tokenizer or model_dir),
                store=store,
                step=step,
                episodes={g.claim_id: g.session_ids for g in groups},
                distributed=cfg.weight_sync == "distributed",
                tied_head_file=config.engine.backend == "vllm",
                broadcaster=broadcaster,
            )
            publish_s = time.perf_counter() - t0
            if info.rank == 0:
                held.mark_trained(groups)
                metrics = {
                    **batch_metrics(groups, advantages, eos_ids=eos_ids, version=version - 1),
                    **step_metrics(stats),
                    "dropped_episodes": float(dropped),
                    **claimer.settling_metrics(),
                    "time_wait_s": wait_s,
                    "time_train_s": train_s,
                    # rank 0's CPU time (all its threads): compute, not waits in
                    # collectives or for a core on a shared host
                    "time_train_cpu_s": train_cpu_s,
                    "time_publish_s": publish_s,
                    **_previous_swap(store, version),
                }
                store.add_train_step(TrainStepRecord(step=step, version=version, metrics=metrics))
                writer.write(step, version, metrics)
            if step % cfg.checkpoint_every == 0 or step == cfg.total_steps:
                save_checkpoint(
                    model,
                    optimizer,
                    checkpoint_dir=config.checkpoint_dir(),
                    step=step,
                    version=version,
                )
                saved_step = step
        if step > saved_step:  # a stopped online run keeps every published update
            save_checkpoint(
                model, optimizer, checkpoint_dir=config.checkpoint_dir(), step=step, version=version
            )
        if info.world_size > 1:
            # Every rank leaves the group together (only on this normal path: after a
            # failure the peers may never come). A rank that tore its group down while
            # another was still finishing once died in gloo's shutdown ("terminate
            # called without an active exception", exit -6) after a clean run.
            dist.barrier()
    log.info("trainer stopped after step %d at policy v%d", step, version)


# ---- start-up -------------------------------------------------------------------------


def _install_signal_handlers(stop: threading.Event) -> Callable[[], None]:
    """SIGTERM/SIGINT set `stop`: a batch being collected is abandoned (claims released),
    a step being trained is finished and published, then the loop ends; a
    second signal gets the default behaviour. Returns a function restoring the old
    handlers. Signals can only be handled in the main thread: elsewhere, `stop` only."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(signum: int, _frame: object) -> None:
        log.warning("%s: stopping after the current hop", signal.Signals(signum).name)
        stop.set()
        for sig in previous:  # the next one is not caught
            signal.signal(
                sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            )

    for sig in previous:
        signal.signal(sig, on_signal)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def claim_group_size(cfg: TrainerConfig) -> int | None:
    """What the claimer waits for per group: `trainer.group_size`, except 1, which means
    ungrouped online sessions (each ended session is a group of its own, with or without
    a `group_id`)."""
    return None if cfg.group_size == 1 else cfg.group_size


def _prepare_model_dir(config: ServiceConfig, info: DistInfo) -> Path:
    """The initial checkpoint (v0): the engine's model. The launcher builds the tiny model
    before starting the trainer when none is configured; the trainer only loads."""
    model_dir = config.model_dir()
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"no checkpoint at {model_dir}: set engine.model, or build the tiny model there "
            f"first (`areal-service make-tiny-model {model_dir}`; `areal-service trainer` "
            "and `areal-service demo --trainer-procs N` do it for you)")
    dist.barrier()
    return model_dir


def reference_model(
    cfg: TrainerConfig, model_dir: Path, *, mixed_precision: bool
) -> torch.nn.Module | None:
    """pi_ref for the KL penalty: `trainer.ref_model`, else the initial checkpoint
    `model_dir` (v0; also after a resume, so the penalty anchors to where training
    started, not to the last checkpoint). None, and nothing loaded, when kl_coef is 0."""
    if cfg.kl_coef == 0:
        return None
    path = Path(cfg.ref_model) if cfg.ref_model else model_dir
    log.info("KL penalty %g: reference model from %s", cfg.kl_coef, path)
    return load_reference(path, mixed_precision=mixed_precision)


def eos_token_ids(model: torch.nn.Module) -> frozenset[int]:
    """EOS ids of the model's generation config and model config (int or list each)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return frozenset(ids)


def recover_claims(store: TrajectoryStore, claimer: EpisodeClaimer) -> tuple[int, int]:
    """Finish what a killed trainer left: claims recorded in a published version row are
    marked trained (their update is live); every other claim is released so its episodes
    are trained once, by us. Returns (sessions marked trained, sessions released)."""
    marked = 0
    for record in store.list_weight_versions(limit=RECOVER_VERSIONS):
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


def resume_point(store: TrajectoryStore, ckpt: CheckpointState | None) -> tuple[int, int]:
    """(last completed step, last published version) to continue from: the larger of the
    checkpoint's and the store's, so steps and versions only ever increase."""
    latest = store.latest_weight_version()
    version = max(ckpt.version if ckpt else 0, latest.version if latest else 0)
    step = max(
        ckpt.step if ckpt else 0,
        int(latest.metadata.get("step", 0)) if latest else 0,
        _last_train_step(store),
    )
    return step, version


def newer_published_weights(store: TrajectoryStore, ckpt: CheckpointState | None
                            ) -> Path | None:
    """The published weights to continue from when the store is ahead of the checkpoint
    (the trainer died after publishing, before checkpointing): the model resumes from
    them, the optimizer from the checkpoint (its moments a few steps old). None when the
    checkpoint is current. If that directory is gone, the updates in between are lost
    to the model (their episodes stay trained, never retrained) and a warning says so."""
    latest = store.latest_weight_version()
    held = ckpt.version if ckpt else 0
    if latest is None or latest.version <= held:
        return None
    path = Path(latest.path)
    if (path / "config.json").is_file() or is_adapter_dir(path):
        log.info("store has published v%d past the checkpoint's v%d: resuming from %s",
                 latest.version, held, path)
        return path
    log.warning("store has published v%d but the checkpoint holds v%d and %s is gone: the "
                "updates in between are lost to the model (their episodes are not "
                "retrained)", latest.version, held, path)
    return None


def _last_train_step(store: TrajectoryStore) -> int:
    last, page = 0, 1000
    while rows := store.list_train_steps(after_step=last, limit=page):
        last = rows[-1].step
    return last


# ---- per step -------------------------------------------------------------------------


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


def _broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (a no-op copy at world size 1)."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _claimer_name() -> str:
    return f"trainer@{socket.gethostname()}:{os.getpid()}"


def wait_for_groups(
    claimer: EpisodeClaimer,
    held: HeldClaims,
    cfg: TrainerConfig,
    version: int,
    pending: list[EpisodeGroup],
    stop: threading.Event,
    timeout_s: float,
) -> int:
    """Rank 0: poll the claimer until `pending` holds `cfg.batch_groups` groups, `stop` is
    set or `timeout_s` passed. Returns the sessions dropped meanwhile (stale, broken)."""
    dropped = 0
    deadline = time.monotonic() + timeout_s
    while len(pending) < cfg.batch_groups and not stop.is_set():
        result = claimer.claim_groups(
            group_size=claim_group_size(cfg),
            max_groups=cfg.batch_groups - len(pending),
            current_version=version,
            max_staleness=cfg.max_staleness,
            claimer=_claimer_name(),
        )
        held.add(result.groups)
        pending.extend(result.groups)
        dropped += sum(len(d.session_ids) for d in result.dropped)
        if len(pending) >= cfg.batch_groups or time.monotonic() >= deadline:
            break
        if not result.groups:
            stop.wait(POLL_INTERVAL_S)
    return dropped


def next_batch(
    claimer: EpisodeClaimer | None,
    held: HeldClaims | None,
    cfg: TrainerConfig,
    version: int,
    stop: threading.Event,
    info: DistInfo,
) -> tuple[list[EpisodeGroup] | None, int, float]:
    """Every rank: the next batch of `cfg.batch_groups` groups (claimed by rank 0 and
    broadcast), the sessions dropped while waiting, and the wait in seconds. None when
    rank 0 was told to stop before the batch filled."""
    start = time.perf_counter()
    pending: list[EpisodeGroup] = []
    dropped = 0
    while True:
        message: tuple[str, list[EpisodeGroup] | None] | None = None
        if info.rank == 0:
            assert claimer is not None and held is not None
            dropped += wait_for_groups(claimer, held, cfg, version, pending, stop, HEARTBEAT_S)
            if stop.is_set():
                message = ("stop", None)
            elif len(pending) >= cfg.batch_groups:
                message = ("batch", pending)
            else:
                message = ("wait", None)
                log.info("waiting for episodes: %d/%d groups", len(pending), cfg.batch_groups)
        kind, groups = _broadcast(message)
        if kind != "wait":
            return groups, dropped, time.perf_counter() - start


def _padding_sequence(sequences: Sequence[TrainSequence]) -> TrainSequence:
    """The shortest real prefix that trains one token: a zero-advantage filler."""
    seq = next((s for s in sequences if any(s.loss_mask[1:])), sequences[0])
    k = next((i for i in range(1, len(seq.input_ids)) if seq.loss_mask[i]), 1)
    n = k + 1
    return dataclasses.replace(
        seq,
        input_ids=seq.input_ids[:n],
        loss_mask=(0,) * k + (1,),
        logprobs=seq.logprobs[:n],
        versions=seq.versions[:n],
    )


def shard_micro_batches(
    groups: Sequence[EpisodeGroup],
    advantages: Sequence[Sequence[float]],
    max_tokens_per_mb: int,
    info: DistInfo,
) -> list[MicroBatch]:
    """This rank's micro-batches, on its device. Every rank packs the same batch
    identically and takes every world_size-th row (rows come largest first, so this
    roughly balances tokens).

    FSDP runs collectives in every forward/backward, so every rank must run the same
    number of micro-batches: ranks short of the maximum (or with none) get a filler that
    trains a single real token with advantage 0. Its policy-gradient term is 0, but the
    token counts in the token-mean normalizer and in the clip/KL/entropy statistics: the
    gradient shrinks by a factor N/(N+fillers), at most world_size - 1 tokens in N.
    """
    sequences = [s for g in groups for s in g.sequences]
    flat = [a for advs in advantages for a in advs]
    rows = build_micro_batches(sequences, flat, max_tokens_per_mb)
    mine = rows[info.rank :: info.world_size]
    per_rank = max(-(-len(rows) // info.world_size), 1)
    if len(mine) < per_rank:
        filler = build_micro_batches([_padding_sequence(sequences)], [0.0], max_tokens_per_mb)
        mine += filler * (per_rank - len(mine))
    return [mb.to(info.device) for mb in mine]


def _previous_swap(store: TrajectoryStore, version: int) -> dict[str, float]:
    """`time_swap_s` of version - 1, once the gateway's syncer recorded it."""
    previous = store.get_weight_version(version - 1)
    swap_s = previous.metadata.get("swap_s") if previous else None
    return {} if swap_s is None else {"time_swap_s": float(swap_s)}


def _cli(argv: Sequence[str] | None = None) -> None:
    """`python -m trainer.train --config X --set a.b=c` (what torchrun launches)."""
    parser = argparse.ArgumentParser(prog="trainer.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", "-c", type=Path, default=None, help="YAML config file.")
    parser.add_argument(
        "--set",
        "-s",
        dest="overrides",
        action="append",
        default=[],
        help="Override a field: section.key=value (repeatable).",
    )
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [rank{rank}] %(name)s: %(message)s",
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if rank == "0":
        log.info("resolved config: %s", json.dumps(config.model_dump(mode="json")))
    main(config)


if __name__ == "__main__":
    _cli()
