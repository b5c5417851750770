"""`areal-service serve`: the gateway, plus the local engine as a child process when no
backend URL or router is configured (the embedded default), or SGLang servers launched or
attached when `engine.backend` is `sglang` or `vllm`."""

from __future__ import annotations

from areal_service.admin_key import DefaultAdminKeyError
from areal_service.config import ServiceConfig, with_admin_key
from engine.tiny_model import ensure_tiny_model
from gateway.server import run_gateway
from launcher.policy_engines import (
    check_policy_ports_free,
    start_policy_engines,
    stop_policy_engines,
)
from launcher.preflight import check_model_dir, check_port_free, check_tokenizer_loadable
from launcher.processes import ChildProcess, cli_argv, exit_on_sigterm, save_config


def ensure_model(config: ServiceConfig, *, here: bool = True) -> None:
    """Build the tiny model at `config.model_dir()` when no checkpoint is configured;
    StartError, in one sentence, when the configured one is not a checkpoint folder.
    `here=False` (Slurm, Ray) skips that check: the path is read on other nodes."""
    if config.engine.model is None:
        ensure_tiny_model(config.model_dir())
    elif here:
        check_model_dir(config.model_dir())


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


def serve(config: ServiceConfig) -> None:
    """Serve the gateway (blocking); a local engine child lives exactly as long, whether
    the gateway stops on Ctrl-C, SIGTERM or an error. The default admin key on a
    non-loopback `gateway.host` stops it before anything starts."""
    try:
        config = with_admin_key(config, binding=True)
    except DefaultAdminKeyError as exc:
        raise SystemExit(f"areal-service serve: {exc}") from None
    with exit_on_sigterm():
        if config.engine.backend in ("sglang", "vllm") and not config.gateway.router.backends:
            from launcher.sglang_servers import sglang_backends
            from launcher.vllm_servers import vllm_backends

            ensure_model(config)  # the tiny model when no checkpoint is configured
            servers = sglang_backends if config.engine.backend == "sglang" else vllm_backends
            check_tokenizer_loadable(config.gateway.tokenizer or config.model_dir())
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
        engine = start_local_engine(config) if local else None
        policy_engines = []
        try:
            # Full-weight policies without given backends: an engine each, beside it.
            policy_engines = start_policy_engines(config)
            run_gateway(config)
        finally:
            stop_policy_engines(policy_engines)
            if engine is not None:
                engine.stop()
