"""The trainer's main loop (`areal-service trainer`, or `torchrun -m trainer.train`): claim
finished, rewarded episode groups from the store, train one decoupled-PPO step on them,
publish the new policy version to the weights directory, mark the episodes trained,
record metrics, checkpoint. Talks only to the store and the weights directory; the
gateway's weight syncer swaps the backends when it sees the new version row.

Versions: the initial model is v0 (what the backends start with). Every step publishes
exactly one version, always above every version the store has seen (`trainer/resume.py`).
Exactly-once training: a step commits when its version row (which lists the step's
claims) is written; sessions are marked trained right after. On start, claims listed
in recent version rows are marked trained and every other claim is released, which
assumes ONE trainer per store (a second trainer's live claims would be released too).
Distributed: rank 0 alone talks to the store (`trainer/rank_zero.py`); it broadcasts the
batch, every rank trains the same number of micro-batches, and rank 0's stop decision is
broadcast. Set-up: `trainer/process.py` (process group, signals, seeds),
`trainer/policy.py` (model, optimizer, reference), `trainer/resume.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from areal_service.config import ServiceConfig, TrainerConfig, load_config
from areal_service.types import EpisodeGroup, TrainSequence
from trainer.advantage import RunningBaseline, sequence_advantages
from trainer.batch import MicroBatch, build_micro_batches
from trainer.canary import CanaryTracker, refusal_streak
from trainer.checkpoint import restore_checkpoint, save_checkpoint
from trainer.cores import share_cores
from trainer.model import DistInfo, resolve_dtype
from trainer.policy import build_policy
from trainer.process import broadcast_from_rank0, start_process
from trainer.publish import publish_weights
from trainer.rank_zero import RankZero
from trainer.resume import resume
from trainer.step import train_step
from trainer.truncation import apply_no_eos

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05
"""How often rank 0 asks the claimer for ready groups while a batch fills up."""
HEARTBEAT_S = 60.0
"""Longest the other ranks wait in one broadcast while rank 0 waits for episodes (well
under the NCCL/gloo collective timeouts, so an idle online trainer never times out)."""


def main(config: ServiceConfig, *, stop: threading.Event | None = None) -> None:
    """Train until `trainer.total_steps` (None: until SIGTERM/SIGINT or `stop` is set)."""
    cfg = config.trainer
    stop = stop or threading.Event()
    with contextlib.ExitStack() as cleanup:  # unwinds in reverse: claims before the store
        info = start_process(cfg, stop, cleanup)
        policy = build_policy(config, info)
        cores = share_cores(config, policy.model, info, cleanup)
        ckpt = restore_checkpoint(policy.model, policy.optimizer, config.checkpoint_dir())
        rank0 = RankZero.open(config, info, cleanup) if info.rank == 0 else None
        step, version = resume(policy.model, rank0.store if rank0 else None, ckpt, cfg.policy)
        saved_step = step  # nothing to checkpoint until this process trains
        checkpoint = functools.partial(
            save_checkpoint, policy.model, policy.optimizer, checkpoint_dir=config.checkpoint_dir()
        )
        baseline = (
            RunningBaseline(cfg.baseline_decay) if cfg.ungrouped_baseline == "task_mean" else None
        )
        log.info("trainer of policy %s starts after step %d at v%d", cfg.policy, step, version)
        tokenizer_dir = Path(config.gateway.tokenizer or policy.model_dir)
        canary = (
            CanaryTracker(
                config.swap_verify,
                tokenizer_dir,
                policy.model,
                info.device,
                resolve_dtype(cfg.dtype, info.device.type),
            )
            if config.swap_verify.enabled
            else None
        )

        while cfg.total_steps is None or step < cfg.total_steps:
            if canary is not None and (why := refused_streak(rank0, config)) is not None:
                log.error("policy %s stops advancing: %s", cfg.policy, why)
                break
            if cores is not None:
                cores.follow(False)  # waiting for episodes: the engine may take every core
            groups, dropped, wait_s = next_batch(rank0, cfg, version, stop, info)
            if groups is None:
                break  # stopped while waiting; rank 0's held claims release the partial batch
            shaped = apply_no_eos(groups, cfg)
            advantages = sequence_advantages(shaped, cfg.advantage, cfg.adv_eps, baseline)
            micro_batches = shard_micro_batches(shaped, advantages, cfg.max_tokens_per_mb, info)
            t0, cpu0 = time.perf_counter(), time.process_time()
            stats = train_step(
                policy.model, policy.optimizer, micro_batches, cfg, ref_model=policy.reference
            )
            train_s, train_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
            if cores is not None:
                cores.follow(False)  # publishing is mostly one thread writing a file
            # A stop signal during training lets the step finish: publishing keeps its
            # work, and the next batch wait sees `stop` and ends the loop.
            step, version = step + 1, version + 1
            t0 = time.perf_counter()
            publish_weights(
                policy.model,
                version=version,
                weights_dir=config.weights_dir(),
                tokenizer_dir=tokenizer_dir,
                store=rank0.store if rank0 else None,
                step=step,
                episodes={g.claim_id: g.session_ids for g in groups},
                distributed=cfg.weight_sync == "distributed",
                tied_head_file=config.engine.backend == "vllm",
                broadcaster=rank0.broadcaster if rank0 else None,
                policy=cfg.policy,
                canary=canary.fingerprint(policy.model) if canary is not None else None,
            )
            publish_s = time.perf_counter() - t0
            if rank0 is not None:
                rank0.record_step(
                    step,
                    version,
                    groups,
                    advantages,
                    stats,
                    dropped=dropped,
                    times={
                        "time_wait_s": wait_s,
                        "time_train_s": train_s,
                        # rank 0's CPU time (all its threads): compute, not
                        # waits in collectives or for a core on a shared host
                        "time_train_cpu_s": train_cpu_s,
                        "time_publish_s": publish_s,
                    },
                )
            if step % cfg.checkpoint_every == 0 or step == cfg.total_steps:
                checkpoint(step=step, version=version)
                saved_step = step
        if step > saved_step:  # a stopped online run keeps every published update
            checkpoint(step=step, version=version)
        if info.world_size > 1:
            # Every rank leaves the group together (only on this normal path: after a
            # failure the peers may never come). A rank that tore its group down while
            # another was still finishing once died in gloo's shutdown ("terminate
            # called without an active exception", exit -6) after a clean run.
            dist.barrier()
    log.info("trainer stopped after step %d at policy v%d", step, version)


# ---- per step -------------------------------------------------------------------------


def refused_streak(rank0: RankZero | None, config: ServiceConfig) -> str | None:
    """Every rank: rank 0's reason to stop (the gateway refused the policy's last
    `swap_verify.max_failures` versions; `trainer/canary.py`), else None. One store
    read per step."""
    why = None
    if rank0 is not None:
        recent = rank0.store.list_weight_versions(
            limit=4 * config.swap_verify.max_failures, policy=config.trainer.policy
        )
        why = refusal_streak(recent, config.swap_verify.max_failures)
    out = broadcast_from_rank0(why)
    return out if isinstance(out, str) else None


def claim_group_size(cfg: TrainerConfig) -> int | None:
    """What the claimer waits for per group: `trainer.group_size`, except 1, which means
    ungrouped online sessions (each ended session is a group of its own, with or without
    a `group_id`)."""
    return None if cfg.group_size == 1 else cfg.group_size


def _claimer_name() -> str:
    return f"trainer@{socket.gethostname()}:{os.getpid()}"


def wait_for_groups(
    rank0: RankZero,
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
        result = rank0.claimer.claim_groups(
            group_size=claim_group_size(cfg),
            max_groups=cfg.batch_groups - len(pending),
            current_version=version,
            max_staleness=cfg.train_staleness_bound(),
            claimer=_claimer_name(),
        )
        rank0.held.add(result.groups)
        pending.extend(result.groups)
        dropped += sum(len(d.session_ids) for d in result.dropped)
        if len(pending) >= cfg.batch_groups or time.monotonic() >= deadline:
            break
        if not result.groups:
            if rank0.policy_deleted():
                log.warning(
                    "policy %s was deleted (its sessions were dropped): the trainer stops",
                    cfg.policy,
                )
                stop.set()  # every rank hears it with the next broadcast
                break
            stop.wait(POLL_INTERVAL_S)
    return dropped


def next_batch(
    rank0: RankZero | None,
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
            assert rank0 is not None
            dropped += wait_for_groups(rank0, cfg, version, pending, stop, HEARTBEAT_S)
            if stop.is_set():
                message = ("stop", None)
            elif len(pending) >= cfg.batch_groups:
                message = ("batch", pending)
            else:
                message = ("wait", None)
                log.info("waiting for episodes: %d/%d groups", len(pending), cfg.batch_groups)
        kind, groups = broadcast_from_rank0(message)
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
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Done, the group destroyed, the store and logs closed. A torchrun rank leaves
        # without the interpreter's teardown: gloo objects still referenced then (the
        # FSDP2 mesh's) are freed during finalization, which now and then aborted a
        # rank after a clean run ("terminate called without an active exception",
        # exit -6; torch's #179291 describes the same), and torchrun fails the job.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    _cli()
