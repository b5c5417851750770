"""Which model names the gateway answers to: the served policy's own name
(`gateway.model_name`) and, per request, the name the client sent."""

from __future__ import annotations

from areal_service.config import GatewayConfig
from gateway.errors import OpenAIError
from gateway.replies import Model
from gateway.state import GatewayState


def resolve_model(gw: GatewayConfig, requested: str) -> str:
    """The name to echo in the reply; 404 `model_not_found` for an unknown name."""
    if requested != gw.model_name:
        raise model_not_found(gw, requested)
    return requested


def model_not_found(gw: GatewayConfig, requested: str) -> OpenAIError:
    """OpenAI's 404 for a model this gateway does not serve."""
    return OpenAIError(404, f"The model `{requested}` does not exist or you do not have "
                       f"access to it. This gateway serves `{gw.model_name}`.",
                       param="model", code="model_not_found")


def model_cards(state: GatewayState) -> list[Model]:
    """The served policy's card, then one per configured alias (same model)."""
    gw = state.config.gateway
    return [Model(id=name, created=int(state.started_at), owned_by="areal-service",
                  max_model_len=state.context_length) for name in served_names(gw)]


def served_names(gw: GatewayConfig) -> list[str]:
    """The policy's name and its aliases, without repeats."""
    return [gw.model_name]
