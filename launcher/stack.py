"""The local process tree of the dataset driver and evaluation: the engine (unless
backends are configured), the gateway and, when training, the trainer — each a child
process started with a saved copy of the resolved config, and stopped in reverse order
(trainer first, so it finishes its step and checkpoints; engine last)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from areal_service.config import GatewayConfig, ServiceConfig, with_gateway_section
from areal_service.cpu_share import host_cores
from engine.tiny_model import ensure_tiny_model
from launcher.policy_engines import (
    check_policy_ports_free,
    local_policy_engines,
    policy_engine_argv,
    with_policy_engines_as_backends,
)
from launcher.preflight import check_model_dir, check_port_free
from launcher.processes import ChildProcess, cli_argv, save_config

READY_TIMEOUT_S = 180.0
"""How long a child may take to answer its health check (model load on a slow disk)."""


def share_cpus(tree: dict[str, Any], trainer_procs: int = 1) -> None:
    """Split this machine's cores between the engine and the trainer(s) in a config tree
    (`ServiceConfig.model_dump()`), where neither was given `torch_threads`: both run at
    once here, and each would otherwise start one thread per core and oversubscribe.
    With the local engine and one trainer process, the split is each side's floor: the
    side with work takes the other's cores while it has none (`cpu_share`)."""
    half = max(1, host_cores() // 2)
    unset = tree["engine"]["torch_threads"] is None and tree["trainer"]["torch_threads"] is None
    if tree["engine"]["torch_threads"] is None:
        tree["engine"]["torch_threads"] = half
    if tree["trainer"]["torch_threads"] is None:
        tree["trainer"]["torch_threads"] = max(1, half // trainer_procs)
    external = GatewayConfig.model_validate(tree["gateway"]).external_backends()
    local_engine = tree["engine"]["backend"] == "local" and not external
    if unset and local_engine and trainer_procs == 1:
        tree["cpu_share"] = True


@dataclass
class Stack:
    """The running children and where to reach the gateway."""

    config: ServiceConfig
    run_dir: Path
    children: list[ChildProcess] = field(default_factory=list)

    @property
    def gateway_url(self) -> str:
        """`http://host:port` of the gateway."""
        return f"http://{self.config.gateway.host}:{self.config.gateway.port}"

    def start(
        self,
        name: str,
        argv: list[str],
        health_url: str | None = None,
        timeout_s: float = READY_TIMEOUT_S,
    ) -> ChildProcess:
        """Start a child (logs in `<data_dir>/logs/<name>.log`), wait for `health_url`."""
        logs = self.config.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        child = ChildProcess(name, argv, log_path=logs / f"{name}.log")
        self.children.append(child)
        if health_url is not None:
            child.wait_http_ok(health_url, timeout_s=timeout_s)
        return child

    def start_trainer(self) -> ChildProcess:
        """The trainer on the saved config; it resumes from its checkpoint by itself."""
        return self.start(
            "trainer", cli_argv("trainer", "--config", str(self.run_dir / "config.yaml"))
        )

    def stop(self) -> None:
        """Stop every child, newest first, saying so first (it can take seconds). The
        trainer gets longer: on SIGTERM it finishes the step under way, publishes and
        checkpoints before exiting."""
        alive = [c.name for c in reversed(self.children) if c.proc.poll() is None]
        if alive:
            trainer = (
                " (the trainer finishes its step and checkpoints first)"
                if "trainer" in alive
                else ""
            )
            names = " and the ".join(
                [", the ".join(alive[:-1]), alive[-1]] if alive[:-1] else alive
            )
            typer.echo(f"stopping the {names}{trainer} ...")
        while self.children:
            child = self.children.pop()
            child.stop()


def engine_ready_timeout_s(config: ServiceConfig) -> float:
    """How long the engine child may take to answer: SGLang's own start bound
    (`engine.sglang.ready_timeout_s`: on a loaded CPU its start took up to ~7 minutes)."""
    if config.engine.backend == "sglang":
        return max(READY_TIMEOUT_S, config.engine.sglang.ready_timeout_s)
    return READY_TIMEOUT_S


def check_stack_ports_free(config: ServiceConfig) -> None:
    """StartError when a port `local_stack(config)` would bind is taken. Checked before
    anything starts (or is built: `demo --model`): a busy port would let the health checks
    reach another server and the command report that server's success as its own."""
    check_port_free(config.gateway.host, config.gateway.port, "gateway.port")
    if not config.gateway.external_backends():
        check_port_free(config.engine.host, config.engine.port, "engine.port")
    check_policy_ports_free(config)


@contextmanager
def local_stack(config: ServiceConfig, run_dir: Path, *, trainer: bool) -> Iterator[Stack]:
    """Engine (unless backends or a router are given), gateway and optionally the trainer, all
    stopped on the way out, whatever ends the block (Ctrl-C included)."""
    local_engine = not config.gateway.external_backends()
    check_stack_ports_free(config)
    if config.engine.model is None:
        ensure_tiny_model(config.model_dir())
    else:
        check_model_dir(config.model_dir())
    backends = config.backend_urls()
    cfg_path = save_config(config, run_dir / "config.yaml")
    # The gateway is pointed at the engine started here; with it, the workers default
    # stays one process (the CPU engine needs the cores), as `serve` alone would choose.
    served = with_gateway_section(
        config, "router", backends=backends if local_engine else config.gateway.router.backends
    )
    served = with_gateway_section(
        served, "scale", workers=config.gateway.scale.workers or (1 if local_engine else 0)
    )
    served = with_policy_engines_as_backends(served)  # the ones started below
    gateway_cfg = save_config(served, run_dir / "gateway.yaml")
    stack = Stack(config, run_dir)
    try:
        if local_engine:
            stack.start(
                "engine",
                cli_argv("engine", "--config", str(cfg_path), "--model", str(config.model_dir())),
                f"{backends[0]}/health",
                engine_ready_timeout_s(config),
            )
        # Full-weight policies without given backends: an engine each (their own pools).
        for name, port in local_policy_engines(config).items():
            stack.start(
                f"engine-{name}",
                policy_engine_argv(config, name, port),
                f"http://{config.engine.host}:{port}/health",
            )
        stack.start(
            "gateway",
            cli_argv("serve", "--config", str(gateway_cfg), "--no-train"),  # trainer: below
            f"{stack.gateway_url}/health/liveness",
        )
        if trainer:
            stack.start_trainer()
        yield stack
    finally:
        stack.stop()
