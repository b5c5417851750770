"""The gateway under uvicorn (blocking). Starting a local engine beside it is the
launcher's job (`launcher/serve.py`): the gateway only speaks to backends by URL."""

from __future__ import annotations

import logging
import sys

import uvicorn

from areal_service.config import ServiceConfig
from gateway.app import create_app

log = logging.getLogger(__name__)


def run_gateway(config: ServiceConfig) -> None:
    """Serve the gateway (blocking) on `gateway.host:gateway.port`."""
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
