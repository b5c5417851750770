"""Time to accuracy: our whole RL system beside TRL's `GRPOTrainer`, same task, same
model, same hyperparameters, same scorer, in one run.

The task is the SmolLM2 demo's (`launcher/demo_task.py:addition_task`): 60 single-digit
additions trained, 40 held out, groups of 4, 16 samples a step, lr 1e-5, 16 new tokens,
temperature 1. Each leg leaves checkpoints with the wall-clock second (from the leg's
own start, start-up included) at which they existed:
- ours: `areal-service demo --model smollm2-135m-instruct --no-baseline` (its own
  evaluation of the untrained policy is eval time) in a data dir of its own; a
  watcher hard-links every published version (`weights/vN`) as it appears, so the
  trainer's pruning of old versions does not lose them;
- TRL: `GRPOTrainer` in a venv of its own (`.venv-trl`: `scripts/build_trl_venv.sh`),
  which saves the policy every `--mark-s` seconds of its training clock; the time a
  save takes is kept off that clock (eval time excluded, as the issue asks).
Then one scorer (HF `generate`, greedy, batch of 40, the served chat template) scores
every checkpoint of both legs on the held-out questions. The report (printed, and
written to `<out>/report.md` over every leg scored there, this run's and earlier
ones') gives each system's curve at the same wall-clock marks (mean and min-max over
seeds), the time each reached 0.875 / 0.925 / 0.95 / 0.975, and TRL's time over ours;
the curves go to `<out>/time-to-accuracy.png` (matplotlib, from the TRL venv).

Placements: `--placement shared` runs both legs at once, one core each (`taskset`);
`--placement sequential` runs them one after the other on all cores. `--engine vllm`
runs our leg on vLLM-CPU (`.venv-vllm`, as `demo --engine vllm`), named `ours_vllm`;
`--legs ours` leaves the TRL legs already in `--out` as they are.

Run (from the repository root, the project's venv active):
    python -m benchmarks.time_to_accuracy run --placement sequential --seeds 1 2 3 --minutes 8
    python -m benchmarks.time_to_accuracy run --placement shared --seeds 1 2 3 --minutes 8
    python -m benchmarks.time_to_accuracy run --engine vllm --legs ours --seeds 1 --minutes 8
The TRL leg alone (what `run` starts, in the TRL venv):
    .venv-trl/bin/python -m benchmarks.time_to_accuracy trl-leg --model DIR --out DIR
Score leg folders again, or only report and plot what is scored:
    python -m benchmarks.time_to_accuracy score LEG_DIR...
    python -m benchmarks.time_to_accuracy report OUT_DIR --minutes 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "smollm2-135m-instruct"
THRESHOLDS = (0.875, 0.925, 0.95, 0.975)
TIMES_FILE = "checkpoints.json"
"""Per leg folder: [{"path": ..., "t": seconds since the leg started, "label": ...}]."""


# ---------------------------------------------------------------- the task, shared
def _task() -> Any:
    from launcher.demo_task import addition_task

    return addition_task()


def _record(out: Path, entries: list[dict[str, Any]]) -> None:
    (out / TIMES_FILE).write_text(json.dumps(entries, indent=1))


# ---------------------------------------------------------------- TRL's leg
def trl_leg(model: Path, out: Path, *, seed: int, minutes: float, mark_s: float) -> None:
    """GRPOTrainer on the demo's task until `minutes` of training clock have passed,
    saving the policy every `mark_s` seconds of that clock (saves are off the clock)."""
    started = time.monotonic()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal_service.rewards.match import numeric_reward

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    task = _task()
    settings = task.trainer
    rows = [
        {"prompt": [{"role": "user", "content": p.text}], "answer": p.answer} for p in task.train
    ]

    def reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [numeric_reward(t, {"answer": a}) for t, a in zip(texts, answer, strict=True)]

    samples = settings["group_size"] * settings["batch_groups"]
    config = GRPOConfig(
        output_dir=str(out / "trl-output"),
        learning_rate=settings["lr"],
        num_generations=settings["group_size"],
        per_device_train_batch_size=samples,
        gradient_accumulation_steps=1,
        max_completion_length=task.max_tokens,
        temperature=1.0,
        beta=0.0,
        num_train_epochs=10_000,  # the clock stops it, not the epochs
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    entries: list[dict[str, Any]] = []
    paused = 0.0

    def clock() -> float:
        return time.monotonic() - started - paused

    def save(label: str) -> None:
        nonlocal paused
        t = clock()
        begun = time.monotonic()
        path = out / label
        policy.save_pretrained(path)
        tokenizer.save_pretrained(path)
        entries.append({"path": str(path), "t": t, "label": label})
        _record(out, entries)
        paused += time.monotonic() - begun

    class Marks(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.next_mark = mark_s

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> Any:
            if clock() >= self.next_mark:
                save(f"step{state.global_step}")
                while self.next_mark <= clock():
                    self.next_mark += mark_s
            if clock() >= minutes * 60:
                control.should_training_stop = True
            return control

    save("step0")
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Marks()],
    )
    trainer.train()


# ---------------------------------------------------------------- our leg
def _watch_versions(weights: Path, out: Path, started: float, stop: threading.Event) -> None:
    """Hard-link each published version as it appears (the trainer prunes old ones)."""
    entries: list[dict[str, Any]] = []
    seen: set[str] = set()
    while not stop.is_set():
        for version in sorted(weights.glob("v*"), key=lambda p: p.stat().st_mtime):
            if version.name in seen or not (version / "config.json").exists():
                continue
            seen.add(version.name)
            target = out / version.name
            try:
                shutil.copytree(version, target, copy_function=os.link)
            except (OSError, shutil.Error):
                continue  # pruned between the glob and the link
            entries.append(
                {"path": str(target), "t": time.monotonic() - started, "label": version.name}
            )
            _record(out, entries)
        stop.wait(0.5)


def ours_leg(
    out: Path,
    model: Path,
    *,
    seed: int,
    minutes: float,
    cpus: str | None,
    engine: str,
    overrides: Sequence[str] = (),
) -> None:
    """`areal-service demo --model smollm2-135m-instruct` with its own data dir, the
    model already built there (linked from `model`, the one TRL's leg loads): its
    one-time build from the wheel is not part of either leg's time. `--no-baseline`: the
    demo's own evaluation of the untrained policy is eval time, off the clock as TRL's
    is (the scorer measures v0 for both: TRL's step 0 is the same model)."""
    data = out / "data"
    shutil.copytree(model, data / "models" / MODEL_NAME, copy_function=os.link)
    argv = [
        sys.executable, "-m", "launcher", "demo", "--model", MODEL_NAME, "--fresh",
        "--no-baseline", "--engine", engine, "--minutes", str(minutes),
        "--set", f"data_dir={data}", "--set", f"trainer.seed={seed}",
        *(arg for o in overrides for arg in ("--set", o)),
    ]  # fmt: skip
    if cpus is not None:
        argv = ["taskset", "-c", cpus, *argv]
    started = time.monotonic()
    stop = threading.Event()
    # The demo serves a registry model from `<data_dir>/demo-<model>/weights/`.
    weights = data / f"demo-{MODEL_NAME}" / "weights"
    watcher = threading.Thread(target=_watch_versions, args=(weights, out, started, stop))
    watcher.start()
    try:
        with open(out / "demo.log", "wb") as log:
            subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, check=False)
    finally:
        stop.set()
        watcher.join()


# ---------------------------------------------------------------- one scorer for both
def score(leg_dirs: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Greedy held-out accuracy of every checkpoint of each leg (HF `generate`, one batch
    of 40, the chat template of the checkpoint), written to `<leg>/scores.json`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    task = _task()
    held_out = task.evals[0].prompts
    results: dict[str, list[dict[str, Any]]] = {}
    for leg in leg_dirs:
        scored = []
        for entry in json.loads((leg / TIMES_FILE).read_text()):
            tokenizer = AutoTokenizer.from_pretrained(entry["path"], padding_side="left")
            model = AutoModelForCausalLM.from_pretrained(entry["path"], dtype=torch.float32)
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p.text}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
                for p in held_out
            ]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                ids = model.generate(
                    **batch, max_new_tokens=task.max_tokens, do_sample=False,
                    pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                )  # fmt: skip
            replies = tokenizer.batch_decode(
                ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
            )
            accuracy = sum(task.reward(p, r) for p, r in zip(held_out, replies, strict=True)) / len(
                held_out
            )
            scored.append({**entry, "accuracy": accuracy})
            print(
                f"{leg.name:>24} {entry['label']:>10} t={entry['t']:7.1f}s  held-out {accuracy:.3f}",
                flush=True,
            )
        (leg / "scores.json").write_text(json.dumps(scored, indent=1))
        results[leg.name] = scored
    return results


def first_time(scored: list[dict[str, Any]], threshold: float) -> float | None:
    """The first wall-clock second at which a checkpoint of the leg reached `threshold`."""
    return next(
        (s["t"] for s in sorted(scored, key=lambda s: s["t"]) if s["accuracy"] >= threshold), None
    )


def accuracy_at(scored: list[dict[str, Any]], t: float) -> float | None:
    """The leg's held-out accuracy at wall-clock second `t`: its newest checkpoint by then."""
    before = [s for s in scored if s["t"] <= t]
    return max(before, key=lambda s: s["t"])["accuracy"] if before else None


def leg_key(name: str) -> tuple[str, str, int]:
    """`<placement>-<system>-seed<N>` -> (placement, system, seed). Systems: `ours` (the
    local engine), `ours_vllm` (vLLM-CPU), `trl`."""
    head, seed = name.rsplit("-seed", 1)
    placement, system = head.split("-", 1)
    return placement, system, int(seed)


def group_legs(
    results: dict[str, list[dict[str, Any]]],
) -> dict[tuple[str, str], dict[int, list[dict[str, Any]]]]:
    """{(placement, system): {seed: scored checkpoints}}."""
    out: dict[tuple[str, str], dict[int, list[dict[str, Any]]]] = {}
    for name, scored in results.items():
        placement, system, seed = leg_key(name)
        out.setdefault((placement, system), {})[seed] = scored
    return out


def threshold_times(
    seeds: dict[int, list[dict[str, Any]]], threshold: float
) -> tuple[float | None, float, float, int]:
    """Over seeds: (mean, min, max, seeds reaching it) of the time to `threshold`. The
    mean counts only when every seed reached it (None otherwise: a censored time is not
    averaged in as if it were one); min and max are over the seeds that did."""
    times = [t for t in (first_time(s, threshold) for s in seeds.values()) if t is not None]
    mean = statistics.fmean(times) if times and len(times) == len(seeds) else None
    return mean, min(times, default=float("nan")), max(times, default=float("nan")), len(times)


def curve(
    seeds: dict[int, list[dict[str, Any]]], marks: list[float]
) -> list[tuple[float, float, float] | None]:
    """Per mark: (mean, min, max) of the seeds' accuracy, None before every seed has a
    checkpoint."""
    out: list[tuple[float, float, float] | None] = []
    for m in marks:
        values = [accuracy_at(s, m) for s in seeds.values()]
        known = [v for v in values if v is not None]
        out.append(
            (statistics.fmean(known), min(known), max(known)) if len(known) == len(values) else None
        )
    return out


def report(
    results: dict[str, list[dict[str, Any]]], mark_s: float = 60.0, budget_s: float | None = None
) -> str:
    """The curves at the same wall-clock marks (mean and spread over seeds), the time to
    each threshold, and TRL's time over ours per placement (above 1: we are faster).
    Printed and returned as Markdown. `budget_s`: each leg's time budget; a threshold TRL
    never reached makes the ratio a lower bound (TRL's time is at least the budget)."""
    groups = group_legs(results)
    end = max((s["t"] for scored in results.values() for s in scored), default=0.0)
    marks = [mark_s * (i + 1) for i in range(int(end // mark_s) + 1)]
    lines = ["### Held-out greedy accuracy at each wall-clock mark (mean [min-max] over seeds)", ""]
    lines.append(
        "| placement, system, seeds | " + " | ".join(f"{m / 60:g} min" for m in marks) + " |"
    )
    lines.append("|---" * (len(marks) + 1) + "|")
    for (placement, system), seeds in sorted(groups.items()):
        cells = [
            f"{c[0]:.3f} [{c[1]:.3f}-{c[2]:.3f}]"
            if c and len(seeds) > 1
            else (f"{c[0]:.3f}" if c else "-")
            for c in curve(seeds, marks)
        ]
        lines.append(f"| {placement}, {system}, {len(seeds)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "### Time to each threshold, seconds from the leg's start (mean [min-max], seeds reaching it)",
        "",
    ]
    lines.append("| placement, system | " + " | ".join(f"{t}" for t in THRESHOLDS) + " |")
    lines.append("|---" * (len(THRESHOLDS) + 1) + "|")
    for (placement, system), seeds in sorted(groups.items()):
        cells = []
        for t in THRESHOLDS:
            mean, lo, hi, n = threshold_times(seeds, t)
            if n == 0:
                cells.append(f"not reached (0/{len(seeds)})")
            else:
                head = f"{mean:.0f}" if mean is not None else "-"
                cells.append(f"{head} [{lo:.0f}-{hi:.0f}] ({n}/{len(seeds)})")
        lines.append(f"| {placement}, {system} | " + " | ".join(cells) + " |")
    lines += ["", "### TRL's time over ours (mean over seeds; above 1: ours is faster)", ""]
    lines.append("| placement, system | " + " | ".join(f"{t}" for t in THRESHOLDS) + " |")
    lines.append("|---" * (len(THRESHOLDS) + 1) + "|")
    for (placement, system), seeds in sorted(groups.items()):
        trl = groups.get((placement, "trl"))
        if system == "trl" or trl is None:
            continue
        cells = []
        for t in THRESHOLDS:
            ours_t, _, _, _ = threshold_times(seeds, t)
            trl_t, _, _, trl_n = threshold_times(trl, t)
            if ours_t is None:
                cells.append("-")
            elif trl_t is not None:
                cells.append(f"{trl_t / ours_t:.2f}x")
            elif budget_s is not None:  # TRL missed it in some seed: at least the budget
                reached = [first_time(s, t) for s in trl.values()]
                lower = statistics.fmean([r if r is not None else budget_s for r in reached])
                cells.append(f">= {lower / ours_t:.2f}x")
            else:
                cells.append("-")
        lines.append(f"| {placement}, {system} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def plot(root: Path, out: Path) -> None:
    """Each placement's curves (mean over seeds, min-max shaded) to one PNG. Needs
    matplotlib (in the TRL venv: `scripts/build_trl_venv.sh`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = {
        leg.name: json.loads((leg / "scores.json").read_text())
        for leg in sorted(root.iterdir())
        if (leg / "scores.json").exists()
    }
    groups = group_legs(results)
    placements = sorted({p for p, _ in groups})
    colours = {name: f"C{i}" for i, name in enumerate(sorted({s for _, s in groups}))}
    fig, axes = plt.subplots(1, len(placements), figsize=(6 * len(placements), 4), squeeze=False)
    end = max(s["t"] for scored in results.values() for s in scored)
    marks = [i * 5.0 for i in range(int(end // 5) + 2)]
    for ax, placement in zip(axes[0], placements, strict=True):
        for (p, system), seeds in sorted(groups.items()):
            if p != placement:
                continue
            points = [(m / 60, c) for m, c in zip(marks, curve(seeds, marks), strict=True) if c]
            xs = [x for x, _ in points]
            line = ax.step(
                xs, [c[0] for _, c in points], where="post", color=colours[system],
                label=f"{system} ({len(seeds)} seed{'s' if len(seeds) > 1 else ''})",
            )  # fmt: skip
            ax.fill_between(
                xs, [c[1] for _, c in points], [c[2] for _, c in points], step="post",
                alpha=0.2, color=line[0].get_color(),
            )  # fmt: skip
        for t in THRESHOLDS[1:3]:
            ax.axhline(t, color="grey", linestyle=":", linewidth=0.8)
        ax.set_title(
            f"{placement}: "
            + (
                "one core each, at once"
                if placement == "shared"
                else "all cores, one after the other"
            )
        )
        ax.set_xlabel("minutes since the leg started (start-up included)")
        ax.set_ylabel("held-out greedy accuracy (40 questions)")
        ax.set_ylim(0.0, 1.0)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"plot: {out}")


# ---------------------------------------------------------------- the whole run
def run(args: argparse.Namespace) -> None:
    from engine.pretrained import make_registry_model

    root = Path(args.out).resolve()
    model = root / "model"
    if not (model / "config.json").exists():
        make_registry_model(MODEL_NAME, model)
    trl_python = Path(args.trl_python)
    if "trl" in args.legs and not trl_python.exists():
        raise SystemExit(f"no TRL venv at {trl_python}: build it with scripts/build_trl_venv.sh")
    system = "ours" if args.engine == "local" else f"ours_{args.engine}"
    if args.variant:  # a setting tried against the same TRL legs: its own curve
        system = f"{system}_{args.variant}"
    shared = args.placement == "shared"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    legs: list[Path] = []
    for seed in args.seeds:
        ours = root / f"{args.placement}-{system}-seed{seed}"
        trl = root / f"{args.placement}-trl-seed{seed}"
        for leg, kind in ((ours, "ours"), (trl, "trl")):
            if kind in args.legs:
                shutil.rmtree(leg, ignore_errors=True)
                leg.mkdir(parents=True)
        trl_argv = [
            str(trl_python), "-m", "benchmarks.time_to_accuracy", "trl-leg", "--model", str(model),
            "--out", str(trl), "--seed", str(seed), "--minutes", str(args.minutes),
        ]  # fmt: skip
        trl_proc = None
        if "trl" in args.legs and shared:  # one core each, at once
            log = open(trl / "trl.log", "wb")  # noqa: SIM115 - closed after the wait
            trl_argv = ["taskset", "-c", "1", *trl_argv]
            trl_proc = subprocess.Popen(
                trl_argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO
            )
        if "ours" in args.legs:
            ours_leg(
                ours,
                model,
                seed=seed,
                minutes=args.minutes,
                cpus="0" if shared else None,
                engine=args.engine,
                overrides=args.set,
            )
            legs.append(ours)
        if trl_proc is not None:
            trl_proc.wait()
            log.close()
        elif "trl" in args.legs:  # all cores, after ours
            with open(trl / "trl.log", "wb") as out:
                subprocess.run(
                    trl_argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, check=False
                )
        if "trl" in args.legs:
            legs.append(trl)
        # Scored now, between legs (no leg's clock runs), and their checkpoints deleted:
        # a leg keeps 0.5 GB a version, 40 versions in 8 minutes.
        seed_legs = [leg for leg in (ours, trl) if leg in legs]
        score(seed_legs)
        prune(seed_legs)
    summarize(root, args.minutes * 60, trl_python)


def prune(legs: list[Path]) -> None:
    """Delete the scored legs' checkpoints, and our leg's published weights, resumable
    checkpoints and model copy (its scores, logs, store and the list of checkpoints
    stay)."""
    for leg in legs:
        for entry in json.loads((leg / TIMES_FILE).read_text()):
            shutil.rmtree(entry["path"], ignore_errors=True)
        for run in (leg / "data").glob("demo-*"):
            for heavy in ("weights", "checkpoints"):
                shutil.rmtree(run / heavy, ignore_errors=True)
        shutil.rmtree(leg / "data" / "models", ignore_errors=True)
        shutil.rmtree(leg / "trl-output", ignore_errors=True)


def summarize(root: Path, budget_s: float | None, plot_python: Path) -> None:
    """The report over every scored leg under `root` (this run's and earlier ones'), to
    `report.md`, and the plot to `time-to-accuracy.png` (drawn by `plot_python`, which
    has matplotlib: the TRL venv)."""
    results = {
        leg.name: json.loads((leg / "scores.json").read_text())
        for leg in sorted(root.iterdir())
        if (leg / "scores.json").exists()
    }
    (root / "report.md").write_text(report(results, budget_s=budget_s) + "\n")
    subprocess.run(
        [str(plot_python), "-m", "benchmarks.time_to_accuracy", "plot", str(root)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, check=False,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    trl_python = str(REPO / ".venv-trl" / "bin" / "python")
    p = sub.add_parser("run")
    p.add_argument("--placement", choices=["shared", "sequential"], default="sequential")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--minutes", type=float, default=12.0)
    p.add_argument("--engine", choices=["local", "vllm"], default="local")
    p.add_argument("--legs", nargs="+", choices=["ours", "trl"], default=["ours", "trl"])
    p.add_argument("--set", action="append", default=[], help="a setting for our leg's demo")
    p.add_argument("--variant", default="", help="names our leg's curve when --set is used")
    p.add_argument("--out", default="data/time-to-accuracy")
    p.add_argument("--trl-python", default=trl_python)
    p = sub.add_parser("trl-leg")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--minutes", type=float, default=12.0)
    p.add_argument("--mark-s", type=float, default=30.0)
    p = sub.add_parser("score")
    p.add_argument("legs", type=Path, nargs="+")
    p = sub.add_parser("report")
    p.add_argument("root", type=Path)
    p.add_argument("--minutes", type=float, default=None, help="each leg's budget")
    p.add_argument("--trl-python", default=trl_python)
    p = sub.add_parser("plot")
    p.add_argument("root", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    elif args.command == "trl-leg":
        args.out.mkdir(parents=True, exist_ok=True)
        trl_leg(args.model, args.out, seed=args.seed, minutes=args.minutes, mark_s=args.mark_s)
    elif args.command == "score":
        score(args.legs)
    elif args.command == "report":
        budget = args.minutes * 60 if args.minutes is not None else None
        summarize(args.root.resolve(), budget, Path(args.trl_python))
    else:
        plot(args.root, args.root / "time-to-accuracy.png")


if __name__ == "__main__":
    main()
