"""`areal-service launch --scheduler ray`: engines, gateway and trainer placed with Ray
placement groups, each run by a Ray actor as the same CLI command a person would type
(`areal-service engine | serve | trainer`, torchrun for a multi-process trainer), so
Ray adds placement and nothing else: no second code path to test.

Two placement groups: one for the engines and the gateway (bundle per engine server,
`cluster.ray.strategy`, PACK by default), one for the trainer (one bundle per trainer
node with its GPUs, STRICT_SPREAD over nodes). Ray sets CUDA_VISIBLE_DEVICES of each
actor to the GPUs of its bundle; the child inherits it. Engine ports are
`engine.port + i` for the i-th server, the gateway and the children bind on their
node's address, and the children's config is the resolved config saved under
`<data_dir>/launch/` (a shared filesystem on a real cluster: weights are published
there and loaded by the servers).

An actor's child dies with the actor (PR_SET_PDEATHSIG), so a dead node or a
`ray stop` cannot leave a server holding a GPU.
"""

from __future__ import annotations

import logging
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_service.config import ServiceConfig
from launcher.placement import plan
from launcher.processes import ChildProcess, cli_argv

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0
"""How long an engine or the gateway may take to answer its health check."""


class ProcessActor:
    """Runs one child process on the node Ray placed it (wrapped by `ray.remote` at
    launch, so importing this module does not need Ray)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.child: ChildProcess | None = None

    def node(self) -> dict[str, Any]:
        """Where the actor runs: IP, Ray node id, GPUs Ray gave it."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        """A port free on this node now (for the trainer's rendezvous)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, argv: list[str], log_path: str, env: dict[str, str] | None = None) -> int:
        """Start the child; returns its pid."""
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self.child = ChildProcess(self.name, argv, log_path=Path(log_path), env=env)
        return self.child.proc.pid

    def wait_http_ok(self, url: str, timeout_s: float) -> None:
        """Block until `url` answers 200 (raises if the child died first)."""
        assert self.child is not None
        self.child.wait_http_ok(url, timeout_s)

    def poll(self) -> int | None:
        """The child's exit code, None while it runs."""
        return None if self.child is None else self.child.proc.poll()

    def stop(self) -> int | None:
        """SIGTERM the child's process group, SIGKILL after the grace; its exit code."""
        if self.child is None:
            return None
        self.child.stop()
        return self.child.proc.returncode


@dataclass
class Role:
    """A placed actor and what it runs."""

    name: str
    actor: Any
    node: dict[str, Any]
    url: str | None = None
    pid: int | None = None
    """The child's process id on its node."""


@dataclass
class RayDeployment:
    """The service on a Ray cluster: `start()`, then `wait()` or `stop()`."""

    config: ServiceConfig
    run_dir: Path
    engines: list[Role] = field(default_factory=list)
    gateway: Role | None = None
    trainers: list[Role] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)
    _started_ray: bool = False

    @property
    def gateway_url(self) -> str:
        """`http://ip:port` of the gateway (after `start`)."""
        assert self.gateway is not None and self.gateway.url is not None
        return self.gateway.url

    @property
    def backends(self) -> list[str]:
        """The engine servers' base URLs (after `start`)."""
        return [r.url for r in self.engines if r.url]

    def start(self, *, trainer: bool = True) -> RayDeployment:
        """Place and start engines, then the gateway, then (optionally) the trainer;
        everything started is stopped again if any step fails."""
        import ray

        if not ray.is_initialized():
            ray.init(address=self.config.cluster.ray.address, log_to_driver=False)
            self._started_ray = True
        try:
            self._start(ray, trainer=trainer)
        except BaseException:
            self.stop()
            raise
        return self

    def wait(self, poll_s: float = 2.0) -> int:
        """Block until the trainer exits (its exit code) or an engine or the gateway
        dies (RuntimeError). Without a trainer, until interrupted."""
        import ray

        while True:
            for role in [*self.engines, *([self.gateway] if self.gateway else [])]:
                code = ray.get(role.actor.poll.remote())
                if code is not None:
                    raise RuntimeError(f"{role.name} exited with code {code}")
            codes = ray.get([r.actor.poll.remote() for r in self.trainers])
            if self.trainers and all(c is not None for c in codes):
                return max(codes, key=abs)
            time.sleep(poll_s)

    def stop(self) -> None:
        """Stop the trainer, the gateway, the engines (each child by its actor), then
        remove the actors and placement groups; shut Ray down if this started it."""
        import ray
        from ray.util.placement_group import remove_placement_group

        roles = [*self.trainers, *([self.gateway] if self.gateway else []), *reversed(self.engines)]
        for role in roles:
            try:
                ray.get(role.actor.stop.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - a dead actor's child died with it
                log.warning("could not stop %s cleanly", role.name, exc_info=True)
            ray.kill(role.actor)
        self.trainers, self.gateway, self.engines = [], None, []
        for pg in self.groups:
            remove_placement_group(pg)
        self.groups = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    # --- internals --------------------------------------------------------------------

    def _start(self, ray: Any, *, trainer: bool) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from launcher.processes import save_config
        from launcher.serve import ensure_model

        cfg = self.config.model_copy(update={"data_dir": self.config.data_dir.resolve()})
        ensure_model(cfg, here=False)  # the checkpoint is read on the cluster's nodes
        cfg_path = str(save_config(cfg, self.run_dir.resolve() / "config.yaml"))
        logs = cfg.data_dir / "logs"
        place = plan(cfg)
        cpus = cfg.cluster.ray.cpus_per_process
        remote = ray.remote(ProcessActor)

        def bundle(gpus: int) -> dict[str, float]:
            return {"CPU": cpus, **({"GPU": float(gpus)} if gpus else {})}

        def actor(name: str, pg: Any, index: int, gpus: int) -> Any:
            return remote.options(
                name=None,
                num_cpus=cpus,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=index
                ),
            ).remote(name)

        # Engines and gateway: one bundle per server, the gateway's last.
        n = place.n_servers
        serve_pg = placement_group(
            [*[bundle(place.gpus_per_server)] * n, bundle(0)],
            strategy=cfg.cluster.ray.strategy,
            name="areal-serve",
        )
        self.groups.append(serve_pg)
        ray.get(serve_pg.ready(), timeout=READY_TIMEOUT_S)
        for i in range(n):
            a = actor(f"engine-{i}", serve_pg, i, place.gpus_per_server)
            node = ray.get(a.node.remote())
            port = cfg.engine.port + i
            argv = cli_argv(
                "engine", "--config", cfg_path, "--host", node["ip"], "--port", str(port)
            )
            if cfg.engine.backend == "sglang":  # the supervisor, on the actor's GPUs
                argv += ["--set", "engine.sglang.servers=1", "--set", "engine.sglang.gpus=null"]
            pid = ray.get(a.start.remote(argv, str(logs / f"engine-{i}.log")))
            self.engines.append(Role(f"engine-{i}", a, node, f"http://{node['ip']}:{port}", pid))
        ray.get(
            [
                r.actor.wait_http_ok.remote(f"{r.url}/health_generate", READY_TIMEOUT_S)
                for r in self.engines
            ]
        )
        backends = "gateway.router.backends=[" + ",".join(f'"{u}"' for u in self.backends) + "]"

        a = actor("gateway", serve_pg, n, 0)
        node = ray.get(a.node.remote())
        pid = ray.get(
            a.start.remote(
                cli_argv(
                    "serve",
                    "--config",
                    cfg_path,
                    "--set",
                    f"gateway.host={node['ip']}",
                    "--set",
                    backends,
                ),
                str(logs / "gateway.log"),
            )
        )
        self.gateway = Role("gateway", a, node, f"http://{node['ip']}:{cfg.gateway.port}", pid)
        ray.get(a.wait_http_ok.remote(f"{self.gateway.url}/health/liveness", READY_TIMEOUT_S))
        log.info("gateway at %s/v1, backends %s", self.gateway.url, " ".join(self.backends))
        if trainer:
            self._start_trainer(ray, place, cfg_path, logs, backends, bundle, actor)

    def _start_trainer(
        self,
        ray: Any,
        place: Any,
        cfg_path: str,
        logs: Path,
        backends: str,
        bundle: Any,
        actor: Any,
    ) -> None:
        from ray.util.placement_group import placement_group

        nodes, gpus = len(place.trainer_nodes), len(place.trainer_gpus)
        train_pg = placement_group(
            [bundle(gpus)] * nodes,
            strategy="STRICT_SPREAD" if nodes > 1 else "PACK",
            name="areal-train",
        )
        self.groups.append(train_pg)
        ray.get(train_pg.ready(), timeout=READY_TIMEOUT_S)
        actors = [actor(f"trainer-{i}", train_pg, i, gpus) for i in range(nodes)]
        placed = ray.get([a.node.remote() for a in actors])
        procs = place.trainer_procs_per_node
        master_port = ray.get(actors[0].free_port.remote())
        for i, (a, node) in enumerate(zip(actors, placed, strict=True)):
            if nodes == 1 and procs == 1:
                argv = cli_argv("trainer", "--config", cfg_path, "--set", backends)
            else:
                argv = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    f"--nnodes={nodes}",
                    f"--node-rank={i}",
                    f"--nproc-per-node={procs}",
                    f"--master-addr={placed[0]['ip']}",
                    f"--master-port={master_port}",
                    "-m",
                    "trainer.train",
                    "--config",
                    cfg_path,
                    "--set",
                    backends,
                ]
            pid = ray.get(a.start.remote(argv, str(logs / f"trainer-{i}.log")))
            self.trainers.append(Role(f"trainer-{i}", a, node, pid=pid))


def run_on_ray(config: ServiceConfig, run_dir: Path) -> int:
    """`launch --scheduler ray`: start everything, wait for the trainer, stop all (also
    on Ctrl-C or SIGTERM). Returns the trainer's exit code."""
    from launcher.processes import exit_on_sigterm

    deployment = RayDeployment(config, run_dir)
    with exit_on_sigterm():
        deployment.start()
        try:
            return deployment.wait()
        finally:
            deployment.stop()
