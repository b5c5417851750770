"""Config tree: priorities (defaults < YAML < env < CLI), validation, documentation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from areal_service.config import ServiceConfig, load_config, parse_overrides
from launcher.cli import app


def test_priorities_yaml_env_cli(tmp_path, monkeypatch):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("gateway:\n  port: 8100\n  model_name: from-yaml\nengine:\n  port: 30100\n")
    monkeypatch.setenv("AREAL_GATEWAY__PORT", "8200")
    cfg = load_config(cfg_file, ["engine.port=30300"])
    assert cfg.gateway.model_name == "from-yaml"  # YAML over default
    assert cfg.gateway.port == 8200  # env over YAML
    assert cfg.engine.port == 30300  # CLI over YAML


def test_database_url_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DATABASE_URL", "postgresql+psycopg://u@127.0.0.1/db")
    assert load_config().database_url() == "postgresql+psycopg://u@127.0.0.1/db"
    monkeypatch.delenv("DATABASE_URL")
    cfg = load_config(overrides=[f"data_dir={tmp_path}"])
    assert cfg.database_url() == f"sqlite:///{tmp_path.resolve()}/areal.db"


def test_errors_name_the_key():
    with pytest.raises(ValueError, match="nosuch"):
        load_config(overrides=["gateway.nosuch=1"])
    with pytest.raises(ValueError, match="engine.port and gateway.port"):
        load_config(overrides=["engine.port=8000", "gateway.port=8000"])
    with pytest.raises(ValueError, match="section.key=value"):
        parse_overrides(["novalue"])


def test_every_field_documented():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"
            sub = field.annotation
            if isinstance(sub, type) and hasattr(sub, "model_fields"):
                walk(sub)

    walk(ServiceConfig)


def test_config_show_cli_masks_secret():
    result = CliRunner().invoke(app, ["config", "show", "--set", "gateway.port=8123"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["gateway"]["port"] == 8123
    assert shown["gateway"]["auth"]["admin_key"] == "**********"


def test_cli_flags_ratchet():
    """Keep the CLI small: new top-level commands must be added here on purpose."""
    names = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert names == {
        "config",
        "db",
        "keys",
        "policies",
        "make-tiny-model",
        "make-model",
        "engine",
        "serve",
        "train",
        "export",
        "demo",
        "trainer",
        "eval",
        "launch",
    }


def test_foreign_areal_env_vars_are_ignored(monkeypatch):
    monkeypatch.setenv("AREAL_SAVE_SCREENSHOTS", "1")
    monkeypatch.setenv("AREAL_TEST_POSTGRES_URL", "postgresql://x")
    monkeypatch.setenv("AREAL_LOG_LEVEL", "debug")
    assert load_config().log_level == "debug"


def test_workers_default_follows_where_generation_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """0 (the default): one gateway process in front of the local CPU engine, which needs
    the cores; a quarter of the cores, 1 to 8, in front of external backends or a router
    (a process per core costs more CPU per request where others share the cores)."""
    monkeypatch.setattr("areal_service.config.gateway.host_cores", lambda: 16)
    assert load_config(None, []).gateway.worker_count() == 1
    external = load_config(None, ["gateway.router.backends=[http://10.0.0.1:30000]"]).gateway
    assert external.worker_count() == 4 and not external.shares_store()  # not yet resolved
    assert (
        load_config(None, ["gateway.router.url=http://10.0.0.1:30000"]).gateway.worker_count() == 4
    )
    monkeypatch.setattr("areal_service.config.gateway.host_cores", lambda: 64)
    assert external.worker_count() == 8
    monkeypatch.setattr("areal_service.config.gateway.host_cores", lambda: 2)
    assert external.worker_count() == 1
    assert (
        load_config(
            None, ["gateway.router.backends=[http://10.0.0.1:30000]", "gateway.scale.workers=3"]
        ).gateway.worker_count()
        == 3
    )
    assert load_config(None, ["gateway.scale.workers=3"]).gateway.shares_store()


def test_vllm_refuses_what_it_cannot_do():
    """SGLang's router and SGLang's broadcast protocol are refused with vLLM, by name."""
    with pytest.raises(ValueError, match="gateway.router.url"):
        load_config(overrides=["engine.backend=vllm", "gateway.router.url=http://r:1"])
    with pytest.raises(ValueError, match="weight_sync=disk"):
        load_config(overrides=["engine.backend=vllm", "trainer.weight_sync=distributed"])
    assert load_config(overrides=["engine.backend=vllm"]).engine.vllm.kv_cache_space_gib > 0


def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


def test_shipped_driver_configs_show(tmp_path):
    """`config show` is the dry run of a `train` / `eval` config: the driver's sections
    (`dataset`, `agent`, `rollout`, `eval`) are shown, not refused as unknown."""
    for name in ("train", "eval"):
        result = _cli("config", "show", "--config", f"examples/math/{name}.yaml")
        assert result.exit_code == 0, result.output
        shown = json.loads(result.output)
        assert shown["data_dir"] == "data/math" and "eval" in shown and "rollout" in shown
    shown = json.loads(_cli("config", "show", "--config", "examples/math/train.yaml").output)
    assert shown["dataset"]["path"] == "examples/math/data/train.jsonl"
    assert shown["agent"] == "examples.math.agent:solve"


def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("gateway:\n  port: 1\n engine: x\n")
    result = _cli("config", "show", "--config", str(bad))
    assert result.exit_code == 2
    assert result.output.startswith(f"areal-service: {bad}, line 3, column 2: not valid YAML")
    assert "Traceback" not in result.output and "<unicode string>" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_config_errors_are_one_line_each_with_a_suggestion(tmp_path):
    """No pydantic dump: the file, the dotted setting, what is wrong, and the closest known
    name for a misspelt one; a validator's message without pydantic's "Value error,"."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gatway: {port: 1}\nengine: {prot: 5, port: abc}\n")
    result = _cli("config", "show", "--config", str(cfg))
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        f"areal-service: config errors in {cfg} (or its --set / AREAL_* overrides):",
        "  - `engine.port`: Input should be a valid integer, unable to parse string as an "
        "integer (got 'abc')",
        "  - `engine.prot` is not a setting; did you mean `engine.port`?",
        "  - `gatway` is not a setting; did you mean `gateway`?",
    ]
    one = _cli("config", "show", "--set", "engine.port=8000", "--set", "gateway.port=8000")
    assert one.output == (
        "areal-service: config error in the --set / AREAL_* overrides: "
        "engine.port and gateway.port are both 8000; change one\n"
    )
    driver = _cli("config", "show", "--config", "examples/math/eval.yaml", "--set", "datset.x=1")
    assert "`datset` is not a setting; did you mean `dataset`?" in driver.output
    assert "errors.pydantic.dev" not in result.output + one.output + driver.output


def test_list_items_and_eval_limit_are_settable():
    """`eval.limit` caps every eval dataset; a numeric part reaches into a list."""
    from launcher.driver_config import load_driver_config

    driver, _ = load_driver_config(Path("examples/math/eval.yaml"), ["eval.limit=5"])
    assert [d.limit for d in driver.eval_datasets()] == [5]
    driver, _ = load_driver_config(
        Path("examples/math/eval.yaml"), ["eval.datasets.0.limit=3", "eval.limit=5"]
    )
    assert [d.limit for d in driver.eval_datasets()] == [3]
    assert driver.eval_datasets()[0].name == "arith-test"  # the rest of the item is kept
    wrong = _cli(
        "config", "show", "--config", "examples/math/eval.yaml", "--set", "eval.datasets.1.limit=3"
    )
    assert "'1' is not an index of a list of 1 item(s)" in wrong.output
    guess = _cli(
        "config", "show", "--config", "examples/math/eval.yaml", "--set", "dataset.limit=5"
    )
    assert guess.output.endswith(
        "`dataset.path` is required (to use fewer rows in `eval`, set eval.limit=N)\n"
    )


def test_help_starts_with_what_a_newcomer_runs():
    """`--help` says what the product is, lists demo, serve, train and eval first, shows
    no type placeholders for options, and `--version` answers."""
    top = _cli("--help").output
    assert "(typer)" not in top and top.split("Commands:")[0].count("AReaL Service") == 1
    listed = [
        ln.split()[0]
        for ln in top.split("Commands:")[1].splitlines()
        if ln.startswith("  ") and not ln.startswith("   ")
    ]
    assert listed[:4] == ["demo", "serve", "train", "eval"]
    for command in ("demo", "serve", "train", "eval", "engine", "launch"):
        options = _cli(command, "--help").output.split("Options:")[1]
        assert "<bool>" not in options and "<list[str]>" not in options, command
        assert "<str>" not in options and "<int>" not in options, command
    assert _cli("--version").output.startswith("areal-service ")


def test_keys_list_shows_own_keys_with_utc_times(tmp_path):
    """`keys list` lists the user's keys (session keys counted on stderr, listed with
    --all), times as ISO 8601 UTC, the display's ellipsis as itself."""
    from areal_service.config import load_config
    from areal_service.keys import new_api_key
    from areal_service.store import TrajectoryStore

    created = _cli("keys", "create", "--name", "mine", "--set", f"data_dir={tmp_path}")
    assert created.exit_code == 0, created.output
    config = load_config(overrides=[f"data_dir={tmp_path}"])
    store = TrajectoryStore.open(config.database_url(), config.store)
    try:
        for _ in range(150):
            store.keys.add_api_key(new_api_key(kind="session", session_id="sess_x")[1])
    finally:
        store.close()
    result = CliRunner().invoke(app, ["keys", "list", "--set", f"data_dir={tmp_path}"])
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)
    assert [k["name"] for k in listed] == ["mine"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", listed[0]["created_at"])
    assert "…" in listed[0]["display"] and "\\u2026" not in result.stdout
    assert "(150 session keys not listed: --all lists them)" in result.stderr
    every = json.loads(
        CliRunner()
        .invoke(app, ["keys", "list", "--all", "--limit", "500", "--set", f"data_dir={tmp_path}"])
        .stdout
    )
    assert len(every) == 151


def test_constructing_the_model_reads_no_environment(monkeypatch):
    # Only config_from_tree merges the environment (with its priority over the file and
    # under the overrides); a ServiceConfig built in code is exactly what it was given.
    monkeypatch.setenv("AREAL_GATEWAY__PORT", "8201")
    monkeypatch.setenv("AREAL_DATA_DIR", "/elsewhere")
    cfg = ServiceConfig()
    assert cfg.gateway.port == ServiceConfig.model_fields["gateway"].default_factory().port
    assert cfg.data_dir == Path("./data")
    assert load_config().gateway.port == 8201
