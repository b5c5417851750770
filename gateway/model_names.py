"""Which model names the gateway answers to. By default every name: an agent written for
another provider keeps its own (`gpt-4o-mini`, `default`, ...) and is served by the
policy; the reply echoes the name it sent and the completion records it
(`requested_model`). `gateway.model_names` (a list) turns on strict checking: only the
policy's `model_name` and those aliases are served, any other is 404 `model_not_found`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from areal_service.config import GatewayConfig
from gateway.errors import OpenAIError, bad_request


class Model(BaseModel):
    """A model card of `/v1/models`."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


MAX_MODEL_NAME = 256
"""Longest `model` a request may name (any name within it is served as the policy)."""


def resolve_model(gw: GatewayConfig, requested: str) -> str:
    """The name to echo in the reply (the one sent); 404 `model_not_found` for a name
    outside the strict list, when one is configured; 400 for a name no model has (too
    long to store as one)."""
    if len(requested) > MAX_MODEL_NAME:
        raise bad_request(f"model names are at most {MAX_MODEL_NAME} characters", "model")
    if (
        gw.model_names is not None
        and requested != gw.model_name
        and requested not in gw.model_names
    ):
        raise model_not_found(gw, requested)
    return requested


def model_not_found(gw: GatewayConfig, requested: str) -> OpenAIError:
    """OpenAI's 404 for a model this gateway does not serve."""
    names = ", ".join(f"`{n}`" for n in served_names(gw))
    return OpenAIError(
        404,
        f"The model `{requested}` does not exist or you do not have "
        f"access to it. This gateway serves {names}.",
        param="model",
        code="model_not_found",
    )


def served_names(gw: GatewayConfig) -> list[str]:
    """The policy's name, then its configured aliases (without repeats)."""
    return list(dict.fromkeys([gw.model_name, *(gw.model_names or ())]))


def model_cards(gw: GatewayConfig, created: float, context_length: int) -> list[Model]:
    """One card per served name (all the same policy), as `/v1/models` lists them;
    `created`: when this gateway started."""
    return [model_card(name, created, context_length) for name in served_names(gw)]


def model_card(name: str, created: float, context_length: int) -> Model:
    """The card of the policy under `name`."""
    return Model(
        id=name, created=int(created), owned_by="areal-service", max_model_len=context_length
    )
