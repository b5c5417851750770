"""`cluster:`: the machines `areal-service launch` places the service on (Slurm, Ray)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from areal_service.config.section import Section


class SlurmConfig(Section):
    """`cluster.slurm`: what `areal-service launch --scheduler slurm` writes."""

    job_name: str = "areal"
    """`--job-name`."""
    partition: str | None = None
    """`--partition`. None: the cluster's default."""
    account: str | None = None
    """`--account` to charge. None: the user's default."""
    time: str | None = None
    """`--time` limit, e.g. `24:00:00`. None: the partition's default."""

    @field_validator("time", mode="before")
    @classmethod
    def _sexagesimal(cls, value: object) -> object:
        # Unquoted `12:00:00` is YAML 1.1 base 60: PyYAML reads it as 43200 (seconds).
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{value // 3600}:{value // 60 % 60:02d}:{value % 60:02d}"
        return value

    python: str | None = None
    """Interpreter every node runs the launcher with (a venv on the shared filesystem).
    None: the interpreter that writes the script."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run first on the batch host (module load, venv activation, exports)."""
    sbatch_args: list[str] = Field(default_factory=list)
    """More `#SBATCH` options, verbatim (e.g. `--qos=high`, `--constraint=h100`)."""
    rdzv_port: int = Field(29500, ge=1, le=65535)
    """torchrun rendezvous port on the first trainer node."""


class RayConfig(Section):
    """`cluster.ray`: what `areal-service launch --scheduler ray` does."""

    address: str | None = None
    """Ray cluster to join (`auto`, `ray://host:10001`). None: RAY_ADDRESS when set,
    else a local Ray instance started for the run."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy for the engines, gateway and trainer bundles."""
    cpus_per_process: float = Field(1.0, gt=0)
    """Ray CPUs reserved by each engine, gateway and trainer actor."""


class ClusterConfig(Section):
    """`cluster`: the machines `areal-service launch` places the service on. Rollout
    (SGLang) nodes come first, trainer nodes last; the gateway runs on node 0."""

    n_nodes: int = Field(1, ge=1)
    """Nodes in the job."""
    n_gpus_per_node: int = Field(8, ge=0)
    """GPUs per node."""
    trainer_nodes: int = Field(1, ge=1)
    """The last this-many nodes run the trainer (all their GPUs, torchrun). With one node
    the node is shared: see trainer_gpus."""
    trainer_gpus: int | None = Field(None, ge=0)
    """With n_nodes = 1: the last this-many GPUs train, the rest serve. None: half."""
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    """What `launch --scheduler slurm` writes into the sbatch script."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """Which Ray cluster `launch --scheduler ray` joins and how it places."""

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.n_nodes > 1 and self.trainer_nodes >= self.n_nodes:
            raise ValueError(
                f"cluster.trainer_nodes={self.trainer_nodes} leaves no node of "
                f"cluster.n_nodes={self.n_nodes} for the SGLang servers"
            )
        if self.trainer_gpus is not None and self.trainer_gpus > self.n_gpus_per_node:
            raise ValueError("cluster.trainer_gpus exceeds cluster.n_gpus_per_node")
        return self
