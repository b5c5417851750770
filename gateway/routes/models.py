"""`/v1/models` (also without `/v1`): the names the gateway serves, as model cards."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.deps import PrincipalDep, StateDep
from gateway.errors import ErrorBody
from gateway.model_names import Model, ModelList, model_card, model_cards, resolve_model

router = APIRouter()


@router.get("/v1/models")
@router.get("/models", include_in_schema=False)
async def list_models(state: StateDep, _: PrincipalDep) -> ModelList:
    """The served model and its configured aliases (OpenClaw and others discover it here)."""
    return ModelList(data=model_cards(state.config.gateway, state.started_at, state.context_length))


@router.get("/v1/models/{model_id:path}", responses={404: {"model": ErrorBody}})
@router.get("/models/{model_id:path}", include_in_schema=False)
async def get_model(model_id: str, state: StateDep, _: PrincipalDep) -> Model:
    """The card of any name the gateway serves (all are the policy), or 404
    `model_not_found` under strict `gateway.model_names`."""
    name = resolve_model(state.config.gateway, model_id)
    return model_card(name, state.started_at, state.context_length)
