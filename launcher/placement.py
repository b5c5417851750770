"""Where engines, gateway and trainer go on a cluster (`config.cluster`), decided once
for both schedulers (Slurm and Ray).

Rollout nodes come first and trainer nodes last; the gateway runs on node 0 (a rollout
node: it is CPU-only and close to its first backends). With one node, its GPUs are
split: the first ones serve, the last `cluster.trainer_gpus` train. Engine ports are
`engine.port + i` for the i-th server of a node, so every backend URL is known before
anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_service.config import ServiceConfig


@dataclass(frozen=True)
class Placement:
    """The layout of one launch."""

    n_nodes: int
    rollout_nodes: tuple[int, ...]
    """Indexes (into the job's node list) of the nodes running engines; 0 runs the gateway."""
    trainer_nodes: tuple[int, ...]
    """Indexes of the nodes running the trainer (one torchrun each)."""
    engine_gpus: tuple[int, ...]
    """GPU indexes on each rollout node the engines use."""
    trainer_gpus: tuple[int, ...]
    """GPU indexes on each trainer node the trainer uses (empty: one CPU process)."""
    gpus_per_server: int
    """GPUs per engine server (SGLang tp * dp; the local engine uses at most one)."""
    engine_ports: tuple[int, ...]
    """The engine servers' ports on each rollout node."""

    @property
    def trainer_procs_per_node(self) -> int:
        """torchrun processes per trainer node: one per GPU, one on CPU."""
        return max(1, len(self.trainer_gpus))

    @property
    def n_servers(self) -> int:
        """Engine servers in the whole job."""
        return len(self.rollout_nodes) * len(self.engine_ports)


def plan(config: ServiceConfig) -> Placement:
    """The placement `config.cluster` and `config.engine` describe, or ValueError with
    what to change."""
    cl, eng = config.cluster, config.engine
    gpus = list(range(cl.n_gpus_per_node))
    if cl.n_nodes == 1:
        rollout, trainer = (0,), (0,)
        n_train = cl.trainer_gpus if cl.trainer_gpus is not None else len(gpus) // 2
        engine_gpus, trainer_gpus = gpus[: len(gpus) - n_train], gpus[len(gpus) - n_train :]
    else:
        split = cl.n_nodes - cl.trainer_nodes
        rollout, trainer = tuple(range(split)), tuple(range(split, cl.n_nodes))
        engine_gpus, trainer_gpus = gpus, gpus
    if eng.backend == "sglang":
        per_server = eng.sglang.tp_size * eng.sglang.dp_size
        fit = len(engine_gpus) // per_server
        servers = eng.sglang.servers or fit
        if fit < 1 or servers > fit:
            raise ValueError(
                f"{len(engine_gpus)} engine GPU(s) per rollout node cannot hold {servers or 1} "
                f"SGLang server(s) of {per_server} GPU(s); change cluster.n_gpus_per_node, "
                "cluster.trainer_gpus or engine.sglang.tp_size/dp_size/servers"
            )
        engine_gpus = engine_gpus[: servers * per_server]
    else:  # the local engine: one per rollout node, on one GPU when there is one
        per_server, servers = min(1, len(engine_gpus)), 1
        engine_gpus = engine_gpus[:1]
    return Placement(
        n_nodes=cl.n_nodes,
        rollout_nodes=rollout,
        trainer_nodes=trainer,
        engine_gpus=tuple(engine_gpus),
        trainer_gpus=tuple(trainer_gpus),
        gpus_per_server=per_server,
        engine_ports=tuple(eng.port + i for i in range(servers)),
    )
