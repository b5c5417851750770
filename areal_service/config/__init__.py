"""The one configuration tree of the service (pydantic models), one module per section:
`store`, `engine`, `gateway`, `policies` (`policies:` and `default_policy:`), `trainer`,
`cluster`, the root (`service`) and loading it (`loading`).

Sources, lowest to highest priority: field defaults, a YAML file (`--config`),
environment variables (`AREAL_` prefix, `__` between levels, e.g.
`AREAL_GATEWAY__PORT=9000`; `DATABASE_URL` for the store), then CLI overrides
(`--set gateway.port=9000`). Nothing here is instantiated at import time; call
`load_config`. Torch-free on purpose: the gateway and CLI import it cheaply. Keys of
the previous releases are still read, with a warning naming their new path
(`config_renames.py`). How the policies are served is derived once from this tree by
the serving plan (`areal_service/serving_plan.py`).
"""

from areal_service.config.cluster import ClusterConfig, RayConfig, SlurmConfig
from areal_service.config.engine import EngineConfig, ServerFleetConfig, SGLangConfig, VLLMConfig
from areal_service.config.gateway import (
    AuthConfig,
    ContinuityConfig,
    GatewayConfig,
    LimitsConfig,
    ReasoningParserName,
    RouterConfig,
    SamplingConfig,
    ScaleConfig,
    SessionsConfig,
    SessionSource,
    ToolParserName,
)
from areal_service.config.loading import (
    apply_overrides,
    config_from_tree,
    configure_logging,
    deep_merge,
    load_config,
    parse_overrides,
    read_config_file,
    save_config,
    with_admin_key,
    with_gateway_section,
)
from areal_service.config.policies import (
    LORA_TARGETS,
    POLICY_NAME_PATTERN,
    DefaultPolicyConfig,
    LoRAConfig,
    PolicyCapsConfig,
    PolicyConfig,
    PolicyWeights,
)
from areal_service.config.service import ServiceConfig
from areal_service.config.store import StoreConfig
from areal_service.config.swap_verify import SwapVerifyConfig
from areal_service.config.trainer import AdvantageKind, MismatchMask, TrainerConfig
from areal_service.config_errors import ConfigError
from areal_service.types import DEFAULT_POLICY

__all__ = [
    "DEFAULT_POLICY",
    "LORA_TARGETS",
    "POLICY_NAME_PATTERN",
    "AdvantageKind",
    "AuthConfig",
    "ClusterConfig",
    "ConfigError",
    "ContinuityConfig",
    "DefaultPolicyConfig",
    "PolicyCapsConfig",
    "EngineConfig",
    "GatewayConfig",
    "LimitsConfig",
    "LoRAConfig",
    "MismatchMask",
    "PolicyConfig",
    "PolicyWeights",
    "RayConfig",
    "ReasoningParserName",
    "RouterConfig",
    "SGLangConfig",
    "SamplingConfig",
    "ScaleConfig",
    "ServerFleetConfig",
    "ServiceConfig",
    "SwapVerifyConfig",
    "SessionSource",
    "SessionsConfig",
    "SlurmConfig",
    "StoreConfig",
    "ToolParserName",
    "TrainerConfig",
    "VLLMConfig",
    "apply_overrides",
    "config_from_tree",
    "configure_logging",
    "deep_merge",
    "load_config",
    "parse_overrides",
    "read_config_file",
    "save_config",
    "with_admin_key",
    "with_gateway_section",
]
