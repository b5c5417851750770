"""The gateway under uvicorn (blocking). Starting a local engine beside it is the
launcher's job (`launcher/serve.py`): the gateway only speaks to backends by URL.

With `gateway.scale.workers` > 1, uvicorn's own supervisor runs that many processes on one
listening socket (the kernel hands each new connection to one of them) and restarts a
worker that dies; each worker builds its app with `worker_app`, from the resolved config
saved for it. What must happen once per deployment (weight swaps, idle sweeps) is done by
the holder of the store's leader lease (`gateway/leader.py`); `/metrics` sums every
worker through prometheus_client's multiprocess mode.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import TypedDict, cast

import uvicorn
from fastapi import FastAPI
from prometheus_client.multiprocess import mark_process_dead

from areal_service.config import (
    ServiceConfig,
    configure_logging,
    load_config,
    save_config,
    with_gateway_section,
)
from gateway.app import create_app
from gateway.connections import ConnectionLimits, HttpImpl, protocol_factory
from gateway.metrics import MULTIPROC_ENV

log = logging.getLogger(__name__)

CONFIG_ENV = "AREAL_GATEWAY_WORKER_CONFIG"
"""Path of the resolved config a worker process loads (written 0600 by the parent)."""
SUPERVISOR_ENV = "AREAL_GATEWAY_SUPERVISOR_PID"
"""Pid of the process that runs the workers (their parent while it lives)."""
_PR_SET_PDEATHSIG = 1


class UvicornOptions(TypedDict):
    """`uvicorn.run`'s keywords as the gateway sets them (`uvicorn_options`)."""

    host: str
    port: int
    log_level: str
    access_log: bool
    loop: str
    http: type[asyncio.Protocol]
    proxy_headers: bool
    forwarded_allow_ips: list[str]
    timeout_graceful_shutdown: int


def uvicorn_options(config: ServiceConfig, http: HttpImpl = "httptools") -> UvicornOptions:
    """Every uvicorn option the gateway runs with (the one place they are set; tests
    serve through it too, with either HTTP implementation)."""
    gw = config.gateway
    return {
        "host": gw.host,
        "port": gw.port,
        "log_level": config.log_level,
        "access_log": False,
        # uvloop + httptools (uvicorn[standard]): what "auto" picks when installed; named
        # so a missing one fails at start instead of silently serving on the slow pair.
        "loop": "uvloop",
        # uvicorn's HTTP/1.1 protocol with header/body timeouts and a connection cap
        # (`gateway/connections.py`).
        # cast: uvicorn types `http` as a protocol class, but only calls what it is given
        # (once per connection), so a factory works.
        "http": cast(
            "type[asyncio.Protocol]",
            protocol_factory(
                http,
                ConnectionLimits(
                    header_timeout_s=gw.limits.header_timeout_s,
                    body_timeout_s=gw.limits.body_timeout_s,
                    max_connections=gw.limits.max_connections,
                ),
            ),
        ),
        # X-Forwarded-* only from the proxies named (uvicorn's default trusts loopback,
        # which let any local client pick the address the auth throttle counts).
        "proxy_headers": bool(gw.auth.forwarded_allow_ips),
        "forwarded_allow_ips": list(gw.auth.forwarded_allow_ips),
        # Requests still waiting (e.g. on the staleness gate) are cancelled after this,
        # so SIGTERM never needs a SIGKILL behind it.
        "timeout_graceful_shutdown": 3,
    }


def run_gateway(config: ServiceConfig) -> None:
    """Serve the gateway (blocking) on `gateway.host:gateway.port` with
    `gateway.worker_count()` processes."""
    workers = config.gateway.worker_count()
    config = with_gateway_section(config, "scale", workers=workers)  # resolved
    log.info(
        "gateway on http://%s:%d/v1 (%d worker%s)",
        config.gateway.host,
        config.gateway.port,
        workers,
        "" if workers == 1 else "s",
    )
    if workers == 1:
        sys.setswitchinterval(config.gateway.scale.gil_switch_interval_ms / 1000.0)
        uvicorn.run(create_app(config, freeze_gc=True), **uvicorn_options(config))
        return
    run_dir = config.data_dir / "gateway"
    metrics_dir = run_dir / "metrics"
    shutil.rmtree(metrics_dir, ignore_errors=True)  # a previous run's workers' values
    metrics_dir.mkdir(parents=True)
    # Read by the workers (spawned: fresh interpreters inheriting this environment)
    # before they import prometheus_client.
    os.environ[MULTIPROC_ENV] = str(metrics_dir)
    os.environ[CONFIG_ENV] = str(save_config(config, run_dir / "config.yaml"))
    os.environ[SUPERVISOR_ENV] = str(os.getpid())
    uvicorn.run(
        "gateway.server:worker_app", factory=True, workers=workers, **uvicorn_options(config)
    )


def worker_app() -> FastAPI:
    """One worker's app (uvicorn's factory, called in the worker process)."""
    config = load_config(os.environ[CONFIG_ENV])
    configure_logging(config)  # a spawned interpreter: the parent's setup is not inherited
    sys.setswitchinterval(config.gateway.scale.gil_switch_interval_ms / 1000.0)
    _die_with_parent()
    _forget_dead_workers(Path(os.environ[MULTIPROC_ENV]))
    return create_app(config, freeze_gc=True)


def _forget_dead_workers(metrics_dir: Path) -> None:
    """Drop the live gauges (`areal_in_flight_requests`) of workers that died: a new
    worker starts where uvicorn replaced one, and a dead worker's last value would
    otherwise be summed forever. Its counters stay: they are totals."""
    for path in metrics_dir.glob("gauge_live*_*.db"):
        pid = int(path.stem.rsplit("_", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            # ignore: prometheus_client leaves this function unannotated.
            mark_process_dead(pid, str(metrics_dir))  # type: ignore[no-untyped-call]
        except PermissionError:  # alive, another user's
            pass


def _die_with_parent() -> None:
    """SIGTERM this worker when its supervisor dies, even by SIGKILL: an orphaned worker
    would go on answering on the shared port (Linux only; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    # The parent died before prctl: this worker was adopted. (Compared with the pid the
    # supervisor wrote, not with 1: in a container the supervisor may itself be pid 1.)
    if str(os.getppid()) != os.environ.get(SUPERVISOR_ENV, str(os.getppid())):
        os.kill(os.getpid(), signal.SIGTERM)
