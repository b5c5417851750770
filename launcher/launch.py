"""`areal-service launch --scheduler local|ray|slurm`: the whole service — engines (local
or SGLang), gateway, trainer — started by one command, here, on a Ray cluster, or as a
Slurm job. With named policies the local scheduler also runs one trainer per policy
(`PolicyTrainers`), those created at runtime included. Each scheduler runs the same CLI commands (`engine`, `serve`, `trainer` or
torchrun on `trainer.train`) with the resolved config saved under `--out` (default
`<data_dir>/launch/`), so what runs on a cluster is what runs on a laptop.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Literal

from areal_service.config import ServiceConfig
from launcher.placement import plan
from launcher.policy_trainers import PolicyTrainers
from launcher.processes import ChildProcess, cli_argv, exit_on_sigterm

log = logging.getLogger(__name__)

Scheduler = Literal["local", "ray", "slurm"]

GATEWAY_READY_S = 180.0
"""Gateway start on the local engine (model load included); SGLang adds its own wait."""


def launch(
    config: ServiceConfig, scheduler: Scheduler, *, out: Path | None = None, submit: bool = False
) -> int:
    """Run (or, for Slurm, write and optionally submit) the service; an exit code."""
    from launcher.serve import ensure_model

    run_dir = out or config.data_dir / "launch"
    config = config.model_copy(update={"data_dir": config.data_dir.resolve()})
    # The tiny model when no checkpoint is configured; a configured folder is checked
    # only where it is read here (the local scheduler).
    ensure_model(config, here=scheduler == "local")
    if scheduler == "slurm":
        from launcher.slurm import submit as sbatch
        from launcher.slurm import write_sbatch

        script = write_sbatch(config, run_dir)
        log.info("wrote %s", script)
        if submit:
            log.info("submitted job %s", sbatch(script))
        return 0
    if submit:
        raise ValueError("--submit is for --scheduler slurm")
    if scheduler == "ray":
        from launcher.ray_cluster import run_on_ray

        return run_on_ray(config, run_dir)
    return run_local(config, run_dir)


def _local_split(config: ServiceConfig) -> tuple[ServiceConfig, dict[str, str], int]:
    """With SGLang on this host: the engines' GPUs (unless engine.sglang.gpus is set)
    and the trainer's (CUDA_VISIBLE_DEVICES, process count), as `plan` splits one node.
    With the local engine: one trainer process, devices as configured."""
    if config.engine.backend != "sglang" or config.engine.sglang.attach:
        return config, {}, 1
    place = plan(config)
    sg = config.engine.sglang
    if sg.gpus is None:
        sg = sg.model_copy(update={"gpus": [str(g) for g in place.engine_gpus]})
        config = config.model_copy(
            update={"engine": config.engine.model_copy(update={"sglang": sg})}
        )
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in place.trainer_gpus)}
    return config, env, place.trainer_procs_per_node


def trainer_argv(config_path: Path, procs: int) -> list[str]:
    """`areal-service trainer` for one process, torchrun (standalone) for several."""
    if procs == 1:
        return cli_argv("trainer", "--config", str(config_path))
    return [
        cli_argv()[0],
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={procs}",
        "-m",
        "trainer.train",
        "--config",
        str(config_path),
    ]


POLICY_POLL_S = 2.0
"""How often `launch` looks for policies created at runtime, to start their trainers."""


def run_local(config: ServiceConfig, run_dir: Path) -> int:
    """`--scheduler local`: the gateway (which starts its engines: the local engine, or
    SGLang servers per GPU group), the default policy's trainer and one trainer per named
    policy (the config's, and those created at runtime while it runs) as children of this
    process; returns when the default trainer does (or on Ctrl-C / SIGTERM), stopping
    the trainers first."""
    from launcher.processes import save_config

    config, trainer_env, procs = _local_split(config)
    cfg_path = save_config(config, run_dir / "config.yaml")
    logs = config.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ready_s = GATEWAY_READY_S + (
        config.engine.sglang.ready_timeout_s if config.engine.backend == "sglang" else 0.0
    )
    children: list[ChildProcess] = []
    policies: PolicyTrainers | None = None
    with exit_on_sigterm():
        try:
            gateway = ChildProcess(
                "gateway",
                cli_argv("serve", "--config", str(cfg_path), "--no-train"),  # trainers: below
                log_path=logs / "gateway.log",
            )
            children.append(gateway)
            url = f"http://{config.gateway.host}:{config.gateway.port}"
            gateway.wait_http_ok(f"{url}/health/liveness", ready_s)
            log.info("gateway at %s/v1", url)
            trainer = ChildProcess(
                "trainer",
                trainer_argv(cfg_path, procs),
                log_path=logs / "trainer.log",
                env=trainer_env,
            )
            children.append(trainer)
            policies = PolicyTrainers(config, cfg_path, logs, trainer_env, children)
            policies.start([p.name for p in config.policies])
            while trainer.proc.poll() is None:
                time.sleep(POLICY_POLL_S)
                policies.poll()
            return trainer.proc.wait()
        finally:
            while children:
                children.pop().stop()
            if policies is not None:
                policies.close()
