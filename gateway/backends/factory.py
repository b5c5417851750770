"""The one place in the gateway that reads the engine kind (`EngineConfig.backend`): which
`Backend` sibling serves a URL, and with which adapter naming. Everything above takes
the clients this makes and cannot tell engines apart."""

from __future__ import annotations

from collections.abc import Callable

from areal_service.config import ServiceConfig
from areal_service.lora_adapter import ADAPTER_NAME
from areal_service.serving_plan import ServingPlan
from areal_service.types import DEFAULT_POLICY
from gateway.adapters import AdapterNames
from gateway.backends.base import Backend
from gateway.backends.sglang import SGLangClient
from gateway.backends.vllm import VLLMClient

ClientFactory = Callable[[str], Backend]
"""Makes the client of one backend URL (a pool calls it per URL, also for a router's
newly listed workers)."""


def adapter_names(config: ServiceConfig) -> AdapterNames | None:
    """One server's versioned adapter names (`gateway/adapters.py`), or None where the
    backend does not load adapters by name: the serving plan says which policies' adapters
    are versioned (SGLang's every one, the default's too; vLLM's named ones, and its
    default's once `policies:` are declared). Retired names wait two syncer polls (other
    gateway processes' view) and at most one request timeout."""
    plan = ServingPlan(config)
    if not plan.engine.adapters_by_name:
        return None
    router = config.gateway.router
    return AdapterNames(
        default_policy=DEFAULT_POLICY if plan.default.adapter == "versioned" else None,
        grace_s=2 * router.weight_poll_interval_s + 1.0,
        max_wait_s=router.request_timeout_s,
    )


def client_factory(config: ServiceConfig, *, full_weights: bool = False) -> ClientFactory:
    """The client maker of the configured engine: `VLLMClient` for vLLM, else
    `SGLangClient` (SGLang and the local engine speak its protocol). Each client gets
    its own versioned adapter names (one per server). `full_weights`: a full-weight
    policy's own engines, which serve no adapter."""
    timeout_s = config.gateway.router.request_timeout_s
    lora = ServingPlan(config).default.lora is not None and not full_weights
    if config.engine.backend == "vllm":
        # A LoRA default policy: a request of no policy runs under the one served adapter
        served = ADAPTER_NAME if lora else None

        def vllm(url: str) -> Backend:
            names = adapter_names(config) if lora else None
            return VLLMClient(url, timeout_s=timeout_s, lora_name=served, adapters=names)

        return vllm

    def sglang(url: str) -> Backend:
        names = adapter_names(config) if lora else None
        client = SGLangClient(url, timeout_s=timeout_s, adapters=names)
        # The local engine scores prompts between steps, paused too (SGLang queues them).
        client.scores_while_paused = config.engine.backend == "local"
        return client

    return sglang
