"""The root of the config tree (`ServiceConfig`) and the paths derived from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from areal_service.config.cluster import ClusterConfig
from areal_service.config.engine import EngineConfig
from areal_service.config.gateway import GatewayConfig
from areal_service.config.policies import DefaultPolicyConfig, PolicyCapsConfig, PolicyConfig
from areal_service.config.store import StoreConfig
from areal_service.config.swap_verify import SwapVerifyConfig
from areal_service.config.trainer import TrainerConfig
from areal_service.config_renames import move_in_tree
from areal_service.types import DEFAULT_POLICY


class ServiceConfig(BaseModel):
    """Root of the configuration tree. A plain model: `config_from_tree` merges the file,
    the environment and the overrides itself (list indexes, YAML-typed values, the
    `AREAL_` variables that are not config), so constructing one reads no environment."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    data_dir: Path = Path("./data")
    """Where the embedded default keeps its SQLite file, tiny model, weights and runs."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of every component."""
    store: StoreConfig = Field(default_factory=StoreConfig)
    """The trajectory store."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The local SGLang-protocol engine."""
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    """The OpenAI-compatible gateway."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The RL trainer (FSDP2)."""
    swap_verify: SwapVerifyConfig = Field(default_factory=SwapVerifyConfig)
    """The canary that proves each weight swap before traffic trusts it."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Where `areal-service launch` places engines, gateway and trainer (Ray, Slurm)."""
    default_policy: DefaultPolicyConfig = Field(default_factory=DefaultPolicyConfig)
    """The policy every unbound key is served by: its adapter shape and roles."""
    policies: list[PolicyConfig] = Field(default_factory=list)
    """Named policies on the one base model, each with its own LoRA adapter (needs
    `default_policy.lora`: the base stays shared) or its own full weights on its own
    backends (`weights: full`). Empty: the single `default` policy, as before. The
    `default` policy always exists besides the declared ones. How each is served:
    `areal_service/serving_plan.py`."""
    policy_caps: PolicyCapsConfig = Field(default_factory=PolicyCapsConfig)
    """How many policies, and how large an adapter, the deployment may have."""
    cpu_share: bool = False
    """The local engine and a one-process trainer on one CPU host pass the idle side's
    cores to the busy one (`areal_service/cpu_share.py`): each uses all the cores while
    the other has no work, its `torch_threads` otherwise. `demo`, `serve` and the
    dataset driver turn it on for the local engine when neither thread count is set."""

    @model_validator(mode="before")
    @classmethod
    def _accept_moved_keys(cls, data: Any) -> Any:
        # Keys of the previous release (`trainer.lora`) in a tree built outside
        # `config_from_tree` (which moves them per source, so priorities hold).
        if isinstance(data, dict):
            return move_in_tree(data, set(), warn=True)
        return data

    @model_validator(mode="after")
    def _check_ports(self) -> ServiceConfig:
        if self.engine.port and self.engine.port == self.gateway.port:
            raise ValueError(
                f"engine.port and gateway.port are both {self.gateway.port}; change one"
            )
        if self.engine.backend == "vllm" and self.gateway.router.url:
            raise ValueError(
                "gateway.router.url is SGLang's router (its protocol); with "
                "engine.backend vllm the gateway routes between the servers "
                "itself (gateway.router.backends or engine.vllm.attach)"
            )
        if self.engine.backend == "vllm" and self.trainer.weight_sync == "distributed":
            raise ValueError(
                "engine.backend vllm takes new weights from disk: set "
                "trainer.weight_sync=disk (vLLM's own weight-transfer protocol "
                "is not wired to the trainer's broadcast yet)"
            )
        # The rules across the policies' sections are the serving plan's (one function,
        # also run when a policy is created); it reads these models, hence the late import.
        from areal_service.serving_plan import check_plan

        check_plan(self)
        return self

    # Derived paths: one place decides the layout of data_dir.
    def database_url(self) -> str:
        """The store URL: explicit, else SQLite under data_dir."""
        if self.store.url:
            return self.store.url
        return f"sqlite:///{(self.data_dir / 'areal.db').resolve()}"

    def model_dir(self) -> Path:
        """The checkpoint directory the engine serves."""
        return Path(self.engine.model) if self.engine.model else self.data_dir / "tiny-model"

    def weights_dir(self) -> Path:
        """Where the trainer publishes `v{N}/` HF checkpoints: `weights/` for the default
        policy (as before policies existed), `weights/<policy>/` for a declared one."""
        if self.trainer.policy == DEFAULT_POLICY:
            return self.data_dir / "weights"
        return self.data_dir / "weights" / self.trainer.policy

    def checkpoint_dir(self) -> Path:
        """Where the trainer keeps resumable checkpoints (per policy, as `weights_dir`)."""
        if self.trainer.policy == DEFAULT_POLICY:
            return self.data_dir / "checkpoints"
        return self.data_dir / "checkpoints" / self.trainer.policy

    def cpu_share_file(self) -> Path:
        """The small file the engine and the trainer share their cores through."""
        return self.data_dir / "cpu-share"

    def backend_urls(self) -> list[str]:
        """Backends the gateway routes to (the local engine when none is configured)."""
        if self.gateway.router.backends:
            return [u.rstrip("/") for u in self.gateway.router.backends]
        return [f"http://{self.engine.host}:{self.engine.port}"]
