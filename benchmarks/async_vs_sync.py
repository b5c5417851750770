"""Asynchronous vs synchronous RL on the demo workload, in one run.

Runs the demo's workload twice on fresh stores — η = 0 (fully synchronous: the gateway
admits one batch of sessions per trained version) and η = 2 (agents keep generating
while the trainer trains) — and prints episodes trained per second, final reward, and
their ratio, plus the weight-swap time per phase measured by the gateway.

    python -m benchmarks.async_vs_sync [--steps 20] [--minutes 8]

Target: ≥ 2× episodes/s at the same final reward; swap ≤ 0.5 s from publish to every
backend serving the new version (tiny model, CPU).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from areal_service.config import StoreConfig, load_config
from areal_service.store import TrajectoryStore
from engine.tiny_model import ensure_tiny_model
from launcher.demo import demo_config, headline, run_workload
from launcher.demo_task import digits_task


def run_mode(
    base: Path, model: Path, staleness: int, steps: int, minutes: float, ports: tuple[int, int]
) -> dict:
    data = base / f"eta{staleness}"
    data.mkdir(parents=True)
    shutil.copytree(model, data / "tiny-model")
    config = demo_config(
        load_config(
            overrides=[
                f"data_dir={data}",
                f"engine.port={ports[0]}",
                f"gateway.port={ports[1]}",
                "log_level=warning",
            ]
        ),
        steps,
    )
    config = config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"max_staleness": staleness})}
    )
    summary = run_workload(config, minutes=minutes)
    task = digits_task()
    summary["baseline_reward"] = headline(summary["baseline"], task)
    summary["final_reward"] = headline(summary["final"], task)
    store = TrajectoryStore.open(config.database_url(), StoreConfig())
    try:
        rows = store.list_weight_versions(limit=10_000)
        steps_done = store.list_train_steps(limit=10_000)
    finally:
        store.close()
    # Per-step phase split (the first step also loads the model: skipped). With rollout
    # and training on the same cores, overlap can at best hide the shorter phase:
    # sync step = wait + train, async step >= max(wait, train).
    later = [s.metrics for s in steps_done[1:]] or [s.metrics for s in steps_done]
    summary["wait_s"] = statistics.mean(m.get("time_wait_s", 0.0) for m in later)
    summary["train_s"] = statistics.mean(m.get("time_train_s", 0.0) for m in later)
    phases = {"pause_s": [], "update_s": [], "continue_s": [], "publish_to_live_s": []}
    for row in rows:
        for timing in row.metadata.get("swap", {}).values():
            for key in ("pause_s", "update_s", "continue_s"):
                phases[key].append(timing[key])
        if "publish_to_live_s" in row.metadata:
            phases["publish_to_live_s"].append(row.metadata["publish_to_live_s"])
    summary["swap"] = {
        k: (statistics.median(v) if v else float("nan"), max(v, default=float("nan")))
        for k, v in phases.items()
    }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--minutes", type=float, default=8.0)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="areal-async-vs-sync-"))
    try:
        model = ensure_tiny_model(base / "model")
        sync = run_mode(base, model, 0, args.steps, args.minutes, (30611, 8611))
        async_ = run_mode(base, model, 2, args.steps, args.minutes, (30612, 8612))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"\nasync vs sync RL, demo workload, {args.steps} steps of "
        "4 groups x 8 sessions, tiny model on 2 CPU cores (engine, gateway, trainer share them)"
    )
    print(f"{'':28s}{'eta=0 (sync)':>16s}{'eta=2 (async)':>16s}{'ratio':>10s}")
    for key, label in (
        ("trained_episodes_per_s", "episodes trained / s"),
        ("train_wall_s", "training wall time (s)"),
        ("baseline_reward", "baseline reward"),
        ("final_reward", "final reward"),
    ):
        a, b = sync[key], async_[key]
        print(f"{label:28s}{a:16.3f}{b:16.3f}{b / a if a else float('nan'):10.2f}x")
    print("target: >= 2.00x episodes/s at the same final reward")
    wait, train = sync["wait_s"], sync["train_s"]
    print(
        f"sync step phases: waiting for rollouts {wait:.2f} s, training {train:.2f} s; "
        f"overlapping them can give at most (wait + train) / max(wait, train) = "
        f"{(wait + train) / max(wait, train, 1e-9):.2f}x here"
    )
    print("\nweight swap per phase (median / max seconds, every swap of both runs)")
    for key in ("pause_s", "update_s", "continue_s", "publish_to_live_s"):
        s0, s2 = sync["swap"][key], async_["swap"][key]
        print(f"  {key:20s} eta=0 {s0[0]:.3f} / {s0[1]:.3f}   eta=2 {s2[0]:.3f} / {s2[1]:.3f}")
    print("target: publish_to_live_s <= 0.5 s")


if __name__ == "__main__":
    main()
