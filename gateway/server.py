"""`areal-service serve`: the gateway under uvicorn, plus the local engine as a child
process when no backend URL is configured (the embedded default)."""

from __future__ import annotations

import logging
import sys

import uvicorn

from areal_service.config import ServiceConfig
from areal_service.processes import ChildProcess, cli_argv
from areal_service.tiny_model import ensure_tiny_model
from gateway.app import create_app

log = logging.getLogger(__name__)


def start_local_engine(config: ServiceConfig) -> ChildProcess:
    """Start `areal-service engine` for `config` and wait until it is healthy."""
    if config.engine.model is None:
        ensure_tiny_model(config.model_dir())
    logs = config.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    engine = ChildProcess(
        "engine",
        cli_argv("engine", "--model", str(config.model_dir()), "--host", config.engine.host,
                 "--port", str(config.engine.port), "--set", f"log_level={config.log_level}"),
        log_path=logs / "engine.log")
    try:
        engine.wait_http_ok(f"{config.backend_urls()[0]}/health")
    except BaseException:
        engine.stop()
        raise
    return engine


def run_gateway(config: ServiceConfig) -> None:
    """Serve the gateway (blocking) on `gateway.host:gateway.port`."""
    engine = None if config.gateway.backends else start_local_engine(config)
    try:
        log.info("gateway on http://%s:%d/v1", config.gateway.host, config.gateway.port)
        sys.setswitchinterval(config.gateway.gil_switch_interval_ms / 1000.0)
        # uvloop + httptools (uvicorn[standard]): what "auto" picks when installed; named
        # so a missing one fails at start instead of silently serving on the slow pair.
        uvicorn.run(create_app(config, freeze_gc=True), host=config.gateway.host,
                    port=config.gateway.port, log_level=config.log_level, access_log=False,
                    loop="uvloop", http="httptools",
                    # Requests still waiting (e.g. on the staleness gate) are cancelled
                    # after this, so SIGTERM never needs a SIGKILL behind it.
                    timeout_graceful_shutdown=3)
    finally:
        if engine is not None:
            engine.stop()
