"""Trainer tokens/s per process, 1 process vs N (`torch.distributed.run --nproc-per-node
N -m trainer.train`, FSDP2), on the same batches, run one after the other.

Each run gets an identical store seeded with `--groups` finished, rewarded groups of
two sessions (`--prompt`+`--output` tokens each) and trains `--steps` steps of
`--batch-groups` groups. Reported per run: the train step's `tokens_per_s` (tokens
through the forward pass, all ranks, over the step's wall time: forward, backward,
optimizer) divided by the number of processes, median over the steps after the first
(warm-up); and tokens per CPU-second of rank 0 (its compute alone: on a shared host the
wall-clock number also counts waiting for a core, which hits N processes that meet in
collectives harder than one). Every process gets `--threads` intra-op threads; on a CPU box give N x
threads <= cores, or the comparison measures oversubscription.

Measured on a quiet 2-core host: 8192 tokens a step (`--batch-groups 16 --mb-tokens
2048`) 2 vs 1 process 0.87x per process in tokens/s (two runs), 0.92x per CPU-second;
4096 tokens a step 0.72x and 0.78x (the collectives' per-step cost weighs more on a
small step). With other jobs on the machine (load average 5-7) the 2-process run waits
for cores far more than the 1-process one: 0.16-0.80x.

Run: `python -m benchmarks.trainer_procs [--procs 2] [--steps 4] [--threads 1]`
(the tiny model; about a minute on two cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from areal_service.config import load_config
from areal_service.store import TrajectoryStore
from areal_service.types import CompletionRecord, RewardRecord, SessionRecord

REPO = Path(__file__).resolve().parents[1]


def seed(data_dir: Path, groups: int, prompt: int, output: int) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    config = load_config(overrides=[f"data_dir={data_dir}"])
    store = TrajectoryStore.open(config.database_url(), config.store)
    try:
        for g in range(groups):
            for j in range(2):
                sid = f"sess_{g}_{j}"
                store.add_session(SessionRecord(id=sid, group_id=f"grp_{g}"))
                ids = tuple((7 * g + 3 * k + j) % 600 + 10 for k in range(prompt + output))
                store.add_completion(
                    CompletionRecord(
                        id=f"chatcmpl-{g:05d}{j}",
                        model="areal-policy",
                        prompt_ids=ids[:prompt],
                        output_ids=ids[prompt:],
                        output_logprobs=(-3.0,) * output,
                        output_versions=(0,) * output,
                        finish_reason="length",
                        session_id=sid,
                    )
                )
                store.add_reward(RewardRecord(id=f"r-{sid}", value=float(j), session_id=sid))
                store.end_session(sid, "reward")
    finally:
        store.close()


def train(
    data_dir: Path,
    model: Path,
    *,
    procs: int,
    steps: int,
    batch_groups: int,
    threads: int,
    mb_tokens: int,
    extra: Sequence[str] = (),
) -> list[tuple[float, float]]:
    """(tokens/s per process, tokens per CPU-second per process) of each step."""
    sets = [
        f"data_dir={data_dir}",
        f"engine.model={model}",
        "trainer.group_size=2",
        f"trainer.batch_groups={batch_groups}",
        f"trainer.total_steps={steps}",
        "trainer.max_staleness=1000",
        "trainer.checkpoint_every=1000",
        f"trainer.torch_threads={threads}",
        f"trainer.max_tokens_per_mb={mb_tokens}",
        "log_level=warning",
        *extra,
    ]
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={procs}",
        "-m",
        "trainer.train",
    ]
    for item in sets:
        argv += ["--set", item]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AREAL_")}
    env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    config = load_config(overrides=[f"data_dir={data_dir}"])
    store = TrajectoryStore.open(config.database_url(), config.store)
    try:
        rows = sorted(store.list_train_steps(), key=lambda r: r.step)
    finally:
        store.close()
    out = []
    for r in rows:
        tokens = r.metrics["tokens_per_s"] * r.metrics["time_train_s"] / procs
        out.append((r.metrics["tokens_per_s"] / procs, tokens / r.metrics["time_train_cpu_s"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF checkpoint (tiny model)")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-groups", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--output", type=int, default=160)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mb-tokens", type=int, default=1024)
    parser.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        help="more config for both runs, e.g. trainer.grad_sync_every_mb=false",
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainer-procs-bench-"))
    model = args.model
    if model is None:
        from engine.tiny_model import make_tiny_model

        model = make_tiny_model(tmp / "tiny")
    per_proc: dict[int, list[tuple[float, float]]] = {}
    for procs in (1, args.procs):
        data_dir = tmp / f"procs{procs}"
        seed(data_dir, args.batch_groups * args.steps, args.prompt, args.output)
        per_proc[procs] = train(
            data_dir,
            Path(model),
            procs=procs,
            steps=args.steps,
            batch_groups=args.batch_groups,
            threads=args.threads,
            mb_tokens=args.mb_tokens,
            extra=args.extra,
        )
    tokens = args.batch_groups * 2 * (args.prompt + args.output)
    print(
        f"trainer tokens/s per process, {tokens} tokens a step, {args.steps} steps "
        f"(median of steps 2..), {args.threads} thread(s) a process:"
    )
    base = statistics.median(v for v, _ in per_proc[1][1:])
    base_cpu = statistics.median(c for _, c in per_proc[1][1:])
    for procs, values in per_proc.items():
        med = statistics.median(v for v, _ in values[1:])
        cpu = statistics.median(c for _, c in values[1:])
        print(
            f"  {procs} process(es): {med:8.0f} tok/s per process ({med / base:.2f}x of 1; "
            f"steps: {', '.join(f'{v:.0f}' for v, _ in values)}); {cpu:8.0f} tokens per "
            f"CPU-second per process ({cpu / base_cpu:.2f}x)"
        )


if __name__ == "__main__":
    main()
