"""What an earlier run left in a data dir, whose run it was, and starting over.

A trainer resumes from the checkpoint and weights it finds in its data dir, and trains
whatever rewarded episodes the store still holds. That is what a restarted `serve` wants
for its own run, and never what it wants for another command's: after a finished demo in
the same folder, `serve`'s trainer would continue the demo's run (its leftover episodes
first, at the demo's version). So `serve` records whose run it trains
(`<data_dir>/serve/run.json`: the command and the model) and continues only a run it
recorded with the same model; `demo` starts only in a data dir without a run. Each names
what it found and offers `--fresh` (`fresh_start`) or another data dir.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from areal_service.config import ServiceConfig

RUN_RECORD = Path("serve") / "run.json"
"""Under the data dir: the run `serve` trains (`{"command": "serve", "model": ...}`)."""
OTHER_RUNS = {"demo": "the demo's run", "driver": "a dataset-driver (`train`) run"}
"""Run folders of the other commands that train, under the data dir, and how to name them."""


def previous_run(config: ServiceConfig) -> str | None:
    """What an earlier run left in the data dir that a new trainer would resume from (so
    it would train nothing new first, and measure trained weights as a baseline), or None."""
    versions = [p.name for p in config.weights_dir().glob("v[0-9]*") if p.is_dir()]
    if versions:
        newest = max(versions, key=lambda name: int(name[1:]) if name[1:].isdigit() else -1)
        return f"published weights up to {newest} in {config.weights_dir()}"
    checkpoints = config.checkpoint_dir()
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return f"a trainer checkpoint in {checkpoints}"
    return None


def fresh_start(config: ServiceConfig) -> list[Path]:
    """Delete what a previous run left (`previous_run`, the SQLite store with its keys and
    episodes, the run folders of `demo`, `train` and `serve`); the models, the admin key,
    the logs and a configured `store.url` are kept. Returns what was deleted."""
    doomed = [config.weights_dir(), config.checkpoint_dir()]
    doomed += [config.data_dir / name for name in (*OTHER_RUNS, "serve")]
    if config.store.url is None:
        db = config.data_dir / "areal.db"
        doomed += [db, db.with_name("areal.db-wal"), db.with_name("areal.db-shm")]
    gone = []
    for path in doomed:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        gone.append(path)
    return gone


def _model(config: ServiceConfig) -> str:
    return str(config.model_dir().resolve())


def record_serve_run(config: ServiceConfig) -> None:
    """Mark the data dir's run as `serve`'s, on `config`'s model (what `serve_run_conflict`
    reads at the next start)."""
    path = config.data_dir / RUN_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": "serve", "model": _model(config)}) + "\n")


def serve_run_conflict(config: ServiceConfig) -> str | None:
    """Why `serve`'s trainer must not continue the run in the data dir (one sentence with
    the next steps), or None: no run there, or `serve`'s own on the same model."""
    left = previous_run(config)
    if left is None:
        return None
    try:
        record = json.loads((config.data_dir / RUN_RECORD).read_text())
    except (OSError, ValueError):
        record = None
    if isinstance(record, dict) and record.get("model") == _model(config):
        return None
    if isinstance(record, dict):
        whose = f"serve's run on another model ({record.get('model')})"
    else:
        whose = next(
            (name for d, name in OTHER_RUNS.items() if (config.data_dir / d).is_dir()),
            "a run of another command",
        )
    return (
        f"{config.data_dir} holds {whose} ({left}): serve's trainer would continue it, "
        "training its leftover episodes before yours. Start over with `areal-service serve "
        "--fresh` (deletes that run: the store with its keys and episodes, weights, "
        "checkpoints; keeps the models and the admin key), use another folder (--set "
        "data_dir=...), or serve without training (--no-train)"
    )
