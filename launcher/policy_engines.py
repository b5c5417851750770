"""The local engines of the full-weight policies (`policies[].weights: full` without
`backends`): one `areal-service engine` child per such policy, serving the base model at
`engine.host`:its `PolicyPlan.engine_port` (the serving plan), started beside the main engine
and stopped with it. Each starts on the base checkpoint (the policy's v0); the gateway
swaps the policy's published versions onto it."""

from __future__ import annotations

from areal_service.config import ServiceConfig, save_config
from areal_service.serving_plan import ServingPlan
from areal_service.types import DEFAULT_POLICY
from launcher.preflight import check_port_free
from launcher.processes import ChildProcess, cli_argv


def local_policy_engines(config: ServiceConfig) -> dict[str, int]:
    """Full-weight policy -> the port of the local engine started for it (those given
    `backends` run elsewhere and are not listed)."""
    plans = ServingPlan(config).full_weight()
    return {p.name: p.engine_port for p in plans if p.engine_port is not None}


def policy_engine_config(config: ServiceConfig, port: int) -> ServiceConfig:
    """`config` for one policy's engine: the engine on `port`, and no policies (an engine
    serves whatever weights it is sent; the policies' checks, such as the ports being
    apart, are the gateway's and would trip over the changed `engine.port`)."""
    return config.model_copy(
        update={
            "engine": config.engine.model_copy(update={"port": port}),
            "policies": [],
            "trainer": config.trainer.model_copy(update={"policy": DEFAULT_POLICY}),
        }
    )


def with_policy_engines_as_backends(config: ServiceConfig) -> ServiceConfig:
    """`config` with each local policy engine named as its policy's `backends`: for the
    gateway of a process tree that started those engines itself (`launcher/stack.py`),
    as its `gateway.router.backends` names the main engine, so that `serve` starts none."""
    local = local_policy_engines(config)
    host = config.engine.host
    policies = [
        p.model_copy(update={"backends": [f"http://{host}:{local[p.name]}"], "port": None})
        if p.name in local
        else p
        for p in config.policies
    ]
    return config.model_copy(update={"policies": policies})


def policy_engine_argv(config: ServiceConfig, name: str, port: int) -> list[str]:
    """argv of policy `name`'s engine on `port`, its config saved under the data dir."""
    cfg_path = save_config(
        policy_engine_config(config, port), config.data_dir / "serve" / f"engine-{name}.yaml"
    )
    return cli_argv("engine", "--config", str(cfg_path), "--model", str(config.model_dir()))


def check_policy_ports_free(config: ServiceConfig) -> None:
    """StartError, before anything starts, when a policy engine's port is taken."""
    for name, port in local_policy_engines(config).items():
        check_port_free(config.engine.host, port, f"policy {name!r}'s engine port")


def start_policy_engines(config: ServiceConfig) -> list[ChildProcess]:
    """Start the full-weight policies' local engines and wait until each is healthy;
    on any failure the ones already started are stopped before it is raised."""
    logs = config.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started: list[ChildProcess] = []
    try:
        for name, port in local_policy_engines(config).items():
            child = ChildProcess(
                f"engine-{name}",
                policy_engine_argv(config, name, port),
                log_path=logs / f"engine-{name}.log",
            )
            started.append(child)
            child.wait_http_ok(f"http://{config.engine.host}:{port}/health")
    except BaseException:
        stop_policy_engines(started)
        raise
    return started


def stop_policy_engines(engines: list[ChildProcess]) -> None:
    """Stop the engines `start_policy_engines` started, newest first."""
    for child in reversed(engines):
        child.stop()
