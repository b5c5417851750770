"""LoRA against full fine-tuning on the same task for the same number of steps, in one run.

Both arms are the demo's real stack (`launcher.demo.run_workload`: the local engine, the
gateway and the trainer as child processes, the demo's agents posting rewards), on
SmolLM2-135M-Instruct and the single-digit addition task (`launcher.demo_task.
addition_task`: 60 pairs trained, 40 held out, 40 two-digit ones never trained), with
the same GRPO groups (4 sessions a prompt, 4 groups a step), the same step count and
weight sync from disk. Each arm runs with its usual learning rate: full 1e-5 (the
task's), LoRA 1e-4 (rank 8, alpha 16); `--lr-full` / `--lr-lora` change them.

Printed per arm: held-out greedy accuracy (and pass@1 at T=1) before and after, the
two-digit accuracy, the trainer's seconds per step (median of its own `train` and
`publish` timings, and the wall time of the training phase divided by the steps, which
also holds the wait for episodes), the bytes one published version holds, and the
trainer's peak RSS (VmHWM of the trainer process, read every 0.2 s while it runs; the
last reading before it exits is its peak up to that moment). Then LoRA / full ratios.

The learning curve is not smooth at this size: one run per arm, the agents sample at
T=1, and a step that drops below the demo's stop threshold is not retried. Read
accuracy changes of under ~0.1 as noise (40 held-out questions).

Run: `python -m benchmarks.lora_vs_full --model DIR [--steps 12] [--arms full lora]`
(DIR from `areal-service make-model smollm2-135m-instruct DIR`). About 8 minutes per
arm at 12 steps on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEP_LINE = re.compile(r"train (\d+(?:\.\d+)?)s publish (\d+(?:\.\d+)?)s")
"""The trainer's per-step log line (`trainer.metrics.MetricsWriter._line`)."""


@dataclass
class PeakWatch:
    """VmHWM (peak RSS) of this process's child running `areal-service trainer`,
    sampled until `stop` is set."""

    peak_bytes: int = 0
    pid: int | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def _trainer_pid(self) -> int | None:
        me = str(os.getpid())
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = stat.rsplit(")", 1)[1].split()[1]
            if ppid == me and b"trainer" in argv[:4]:
                return int(entry.name)
        return None

    def run(self) -> None:
        while not self.stop.wait(0.2):
            if self.pid is None:
                self.pid = self._trainer_pid()
                continue
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                continue  # exited: the last reading stands
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    self.peak_bytes = max(self.peak_bytes, int(line.split()[1]) * 1024)


def published_bytes(weights_dir: Path) -> tuple[int, int]:
    """(bytes of the newest `v{N}` directory, of its safetensors files only)."""
    versions = sorted(
        (p for p in weights_dir.glob("v*") if p.name[1:].isdigit()), key=lambda p: int(p.name[1:])
    )
    if not versions:
        return 0, 0
    files = [f for f in versions[-1].rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files), sum(
        f.stat().st_size for f in files if f.suffix == ".safetensors"
    )


def run_arm(arm: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One training run: the demo's stack on a fresh data dir; its summary plus figures."""
    from areal_service.config import load_config
    from benchmarks.gateway_overhead import free_port
    from launcher.demo import demo_config, print_table, run_workload
    from launcher.demo_task import addition_task

    task = addition_task()
    data = work / arm
    lora = ["default_policy.lora.rank=8", "default_policy.lora.alpha=16"] if arm == "lora" else []
    config = load_config(
        overrides=[
            f"data_dir={data}",
            f"engine.model={args.model}",
            f"engine.port={free_port()}",
            f"gateway.port={free_port()}",
            "trainer.weight_sync=disk",
            "log_level=info",
            *lora,
        ]
    )
    config = demo_config(config, args.steps, task=task)
    lr = args.lr_lora if arm == "lora" else args.lr_full
    config = config.model_copy(update={"trainer": config.trainer.model_copy(update={"lr": lr})})
    print(f"\n=== {arm}: lr {config.trainer.lr:g}, {args.steps} steps ===", flush=True)
    watch = PeakWatch()
    watcher = threading.Thread(target=watch.run, name="rss-watch", daemon=True)
    watcher.start()
    try:
        summary = run_workload(config, minutes=args.minutes, task=task)
    finally:
        watch.stop.set()
        watcher.join()
    print_table(summary, task)
    log = (data / "logs" / "trainer.log").read_text(errors="replace")
    steps = [(float(t), float(p)) for t, p in STEP_LINE.findall(log)]
    total, tensors = published_bytes(data / "weights")
    summary.update(
        arm=arm,
        lr=config.trainer.lr,
        train_s=statistics.median(s[0] for s in steps) if steps else float("nan"),
        publish_s=statistics.median(s[1] for s in steps) if steps else float("nan"),
        logged_steps=len(steps),
        published_bytes=total,
        published_tensor_bytes=tensors,
        peak_rss=watch.peak_bytes,
    )
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr-full", type=float, default=1e-5)
    parser.add_argument("--lr-lora", type=float, default=1e-4)
    parser.add_argument("--minutes", type=float, default=20.0, help="time cap per arm")
    parser.add_argument("--arms", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--json", type=Path, help="also write the summaries here")
    parser.add_argument(
        "--previous",
        type=Path,
        help="arms measured by an earlier invocation (its --json), printed beside these "
        "and marked as such (for an arm that failed, e.g. on an overloaded machine)",
    )
    args = parser.parse_args(argv)
    from launcher.demo import headline
    from launcher.demo_task import addition_task

    task = addition_task()
    held, two = task.evals[0].name, task.evals[1].name
    results: list[dict[str, Any]] = []
    if args.previous is not None:
        for r in json.loads(args.previous.read_text()):
            r["arm"] += " (earlier run)"
            results.append(r)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lora-vs-full-") as tmp:
        for arm in args.arms:
            results.append(run_arm(arm, args, Path(tmp)))
            if args.json is not None:
                args.json.write_text(json.dumps(results, indent=2))
    print(
        f"\nSmolLM2-135M-Instruct, single-digit addition, the local engine, {args.steps} steps "
        f"each (GRPO, groups of 4, 4 groups a step), {time.monotonic() - started:.0f} s in all"
    )
    header = (
        f"{'arm':<30}{'steps':>6}{'greedy before':>14}{'after':>7}{'pass@1 b/a':>12}"
        f"{'2-digit b/a':>13}{'train s/step':>13}{'publish s':>10}{'wall s/step':>12}"
        f"{'MiB/version':>12}{'peak RSS MiB':>13}"
    )
    print(header)
    for r in results:
        b, f = r["baseline"], r["final"]
        label = f"{r['arm']}, lr {r['lr']:g}"
        wall = r["train_wall_s"] / max(r["trained_steps"], 1)
        print(
            f"{label:<30}{r['trained_steps']:>6}{headline(b, task):>14.3f}"
            f"{headline(f, task):>7.3f}"
            f"{b[held]['pass@1']:>6.3f}/{f[held]['pass@1']:.3f}"
            f"{b[two]['greedy']:>7.3f}/{f[two]['greedy']:.3f}"
            f"{r['train_s']:>13.2f}{r['publish_s']:>10.2f}{wall:>12.1f}"
            f"{r['published_tensor_bytes'] / 2**20:>12.2f}{r['peak_rss'] / 2**20:>13.0f}"
        )
    by = {r["arm"].removesuffix(" (earlier run)"): r for r in results}
    if {"full", "lora"} <= set(by):
        full, lora = by["full"], by["lora"]
        earlier = any(r["arm"].endswith("(earlier run)") for r in (full, lora))
        where = "one arm from an earlier invocation" if earlier else "same run"
        gain = {
            k: headline(v["final"], task) - headline(v["baseline"], task) for k, v in by.items()
        }
        print(
            f"LoRA / full (baseline = full fine-tuning, {where}): held-out greedy gain "
            f"{gain['lora']:+.3f} vs {gain['full']:+.3f}; train s/step "
            f"{lora['train_s'] / full['train_s']:.2f}x; bytes per version "
            f"{lora['published_tensor_bytes'] / full['published_tensor_bytes']:.4f}x "
            f"({full['published_tensor_bytes'] / lora['published_tensor_bytes']:.0f}x fewer); "
            f"peak trainer RSS {lora['peak_rss'] / full['peak_rss']:.2f}x"
        )


if __name__ == "__main__":
    main()
