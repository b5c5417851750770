"""Whose run a data dir holds: `serve` continues its own run on the same model and names
any other (the demo's, the dataset driver's, its own on another model) instead."""

from __future__ import annotations

from pathlib import Path

from areal_service.config import load_config
from launcher.earlier_run import fresh_start, record_serve_run, serve_run_conflict


def _config(data: Path, model: Path):
    return load_config(overrides=[f"data_dir={data}", f"engine.model={model}"])


def test_serve_continues_only_its_own_run_on_the_same_model(tmp_path):
    data, model = tmp_path / "data", tmp_path / "model"
    config = _config(data, model)
    assert serve_run_conflict(config) is None  # nothing there
    (data / "weights" / "v3").mkdir(parents=True)
    assert "a run of another command (published weights up to v3" in (
        serve_run_conflict(config) or ""
    )
    record_serve_run(config)
    assert serve_run_conflict(config) is None  # serve's own: a restart continues it
    other = _config(data, tmp_path / "other-model")
    assert f"serve's run on another model ({model.resolve()})" in (serve_run_conflict(other) or "")
    (data / "serve" / "run.json").unlink()
    (data / "driver").mkdir()
    assert "a dataset-driver (`train`) run" in (serve_run_conflict(config) or "")


def test_fresh_start_deletes_every_command_s_run_and_the_record(tmp_path):
    data = tmp_path / "data"
    config = _config(data, tmp_path / "model")
    for folder in ("weights/v1", "checkpoints/step-1", "demo", "driver", "models/x", "logs"):
        (data / folder).mkdir(parents=True)
    record_serve_run(config)
    (data / "admin_key").write_text("k")
    gone = sorted(p.name for p in fresh_start(config))
    assert gone == ["checkpoints", "demo", "driver", "serve", "weights"]
    assert sorted(p.name for p in data.iterdir()) == ["admin_key", "logs", "models"]
    assert serve_run_conflict(config) is None
