"""Time to accuracy: our whole RL system beside TRL's `GRPOTrainer`, same task, same
model, same hyperparameters, same scorer, in one run.

The task is the SmolLM2 demo's (`launcher/demo_task.py:addition_task`): 60 single-digit
additions trained, 40 held out, groups of 4, 16 samples a step, lr 1e-5, 16 new tokens,
temperature 1. Each leg leaves checkpoints with the wall-clock second (from the leg's
own start, start-up included) at which they existed:
- ours: `areal-service demo --model smollm2-135m-instruct` in a data dir of its own; a
  watcher hard-links every published version (`weights/vN`) as it appears, so the
  trainer's pruning of old versions does not lose them;
- TRL: `GRPOTrainer` in a venv of its own (`.venv-trl`: `scripts/build_trl_venv.sh`),
  which saves the policy every `--mark-s` seconds of its training clock; the time a
  save takes is kept off that clock (eval time excluded, as the issue asks).
Then one scorer (HF `generate`, greedy, batch of 40, the served chat template) scores
every checkpoint of both legs on the held-out questions, and the report gives each
curve at the same wall-clock marks, the time each reached 0.875 / 0.925 / 0.95 / 0.975,
and per seed TRL's time over ours (above 1: we are faster). Not yet: the mean and spread
over seeds, the PNG, and a run of `run` itself (only the TRL leg and the scorer were
smoke-run, one step).

Placements: `--placement shared` runs both legs at once, one core each (`taskset`);
`--placement sequential` runs them one after the other on all cores.

Run (from the repository root, the project's venv active):
    python -m benchmarks.time_to_accuracy run --placement sequential --seeds 1 2 3 --minutes 12
The TRL leg alone (what `run` starts, in the TRL venv):
    .venv-trl/bin/python -m benchmarks.time_to_accuracy trl-leg --model DIR --out DIR
Score existing leg folders again:
    python -m benchmarks.time_to_accuracy score RUN_DIR...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
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


def ours_leg(out: Path, *, seed: int, minutes: float, cpus: str | None, engine: str) -> None:
    """`areal-service demo --model smollm2-135m-instruct` with its own data dir."""
    data = out / "data"
    argv = [
        sys.executable, "-m", "launcher", "demo", "--model", MODEL_NAME, "--fresh",
        "--engine", engine, "--minutes", str(minutes),
        "--set", f"data_dir={data}", "--set", f"trainer.seed={seed}",
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


def report(results: dict[str, list[dict[str, Any]]], mark_s: float = 60.0) -> None:
    """Per leg: the curve at the same wall-clock marks and the time to each threshold;
    per seed (legs named `<placement>-ours-seed<N>` / `-trl-`): TRL's time / ours."""
    end = max((s["t"] for scored in results.values() for s in scored), default=0.0)
    marks = [mark_s * (i + 1) for i in range(int(end // mark_s) + 1)]
    print("\ncurve (held-out greedy at each wall-clock mark, seconds)")
    print("leg".rjust(24) + "".join(f"{m:>7.0f}" for m in marks))
    for name, scored in sorted(results.items()):
        cells = [accuracy_at(scored, m) for m in marks]
        print(
            f"{name:>24}" + "".join(f"{c:>7.3f}" if c is not None else f"{'-':>7}" for c in cells)
        )
    print("\ntime to threshold" + "".join(f"{t:>10}" for t in THRESHOLDS))
    for name, scored in sorted(results.items()):
        times = [first_time(scored, t) for t in THRESHOLDS]
        print(
            f"{name:>24}" + "".join(f"{c:>9.0f}s" if c is not None else f"{'-':>10}" for c in times)
        )
    for name in sorted(n for n in results if "-ours-" in n):
        trl = results.get(name.replace("-ours-", "-trl-"))
        if trl is None:
            continue
        ratios = []
        for t in THRESHOLDS:
            ours_t, trl_t = first_time(results[name], t), first_time(trl, t)
            ratios.append(f"{trl_t / ours_t:>9.2f}x" if ours_t and trl_t else f"{'-':>10}")
        print(f"{'TRL / ours ' + name.split('-ours-')[1]:>24}" + "".join(ratios))


# ---------------------------------------------------------------- the whole run
def run(args: argparse.Namespace) -> None:
    from engine.pretrained import make_registry_model

    root = Path(args.out).resolve()
    model = root / "model"
    if not (model / "config.json").exists():
        make_registry_model(MODEL_NAME, model)
    trl_python = Path(args.trl_python)
    if not trl_python.exists():
        raise SystemExit(f"no TRL venv at {trl_python}: build it with scripts/build_trl_venv.sh")
    legs: list[Path] = []
    for seed in args.seeds:
        ours = root / f"{args.placement}-ours-seed{seed}"
        trl = root / f"{args.placement}-trl-seed{seed}"
        for d in (ours, trl):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        shared = args.placement == "shared"
        trl_argv = [
            str(trl_python), "-m", "benchmarks.time_to_accuracy", "trl-leg", "--model", str(model),
            "--out", str(trl), "--seed", str(seed), "--minutes", str(args.minutes),
        ]  # fmt: skip
        if shared:
            trl_argv = ["taskset", "-c", "1", *trl_argv]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(trl / "trl.log", "wb") as log:
            if shared:
                trl_proc = subprocess.Popen(
                    trl_argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO
                )
                ours_leg(ours, seed=seed, minutes=args.minutes, cpus="0", engine=args.engine)
                trl_proc.wait()
            else:
                ours_leg(ours, seed=seed, minutes=args.minutes, cpus=None, engine=args.engine)
                subprocess.run(
                    trl_argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, check=False
                )
        legs += [ours, trl]
    report(score(legs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run")
    p.add_argument("--placement", choices=["shared", "sequential"], default="sequential")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--minutes", type=float, default=12.0)
    p.add_argument("--engine", choices=["local", "vllm"], default="local")
    p.add_argument("--out", default="data/time-to-accuracy")
    p.add_argument("--trl-python", default=str(REPO / ".venv-trl" / "bin" / "python"))
    p = sub.add_parser("trl-leg")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--minutes", type=float, default=12.0)
    p.add_argument("--mark-s", type=float, default=30.0)
    p = sub.add_parser("score")
    p.add_argument("legs", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    elif args.command == "trl-leg":
        args.out.mkdir(parents=True, exist_ok=True)
        trl_leg(args.model, args.out, seed=args.seed, minutes=args.minutes, mark_s=args.mark_s)
    else:
        report(score(args.legs))


if __name__ == "__main__":
    main()
