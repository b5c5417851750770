"""The console's forms that change policies: create one at runtime
(`/console/policies/new`, what `POST /admin/policies` does), and on a runtime policy's
page set its roles and delete it (`PATCH` and `DELETE /admin/policies/{name}`). Admin
only, CSRF-checked like the console's other forms; the checks and their messages are the
API's (`gateway/policies.py`), shown on the form with its values kept. Its own router,
so the policy pages beside it stay read-only."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import RedirectResponse
from starlette.datastructures import FormData

from areal_service.policy_registry import lora_over_default
from gateway.console.auth import CheckedForm, ConsoleAdmin, ConsoleSession
from gateway.console.policies import policy_page
from gateway.console.routes import render
from gateway.deps import StateDep
from gateway.errors import OpenAIError
from gateway.policies import create_policy, delete_policy, set_policy_roles

router = APIRouter(prefix="/console", include_in_schema=False)

FIELDS = ("name", "rank", "alpha", "target_modules", "model_names", "roles")
"""The form's inputs (all text; blank: the deployment's default)."""


def _form_page(
    request: Request,
    session: ConsoleSession,
    state: StateDep,
    *,
    values: dict[str, str] | None = None,
    error: OpenAIError | None = None,
    created: str = "",
) -> Response:
    lora = state.policy_registry.plan.default.lora
    return render(
        request,
        "policy_new.html",
        session,
        status=error.status if error else 200,
        nav="policies",
        values=values or {},
        error=error,
        created=created,
        default_lora=lora,
        policies=state.policy_registry.names(),
    )


@router.get("/policies/new")
async def new_policy_page(request: Request, state: StateDep, session: ConsoleAdmin) -> Response:
    """The empty form (or, after a creation, the form again with a notice)."""
    return _form_page(request, session, state, created=request.query_params.get("created", ""))


def _number(form: FormData, field: str, kind: type[int] | type[float]) -> int | float | None:
    """A numeric field (blank: None); a 400 naming it when it is not a number."""
    raw = str(form.get(field) or "").strip()
    if not raw:
        return None
    try:
        return kind(raw)
    except ValueError:
        raise OpenAIError(
            400, f"lora.{field}: not a number: {raw!r}", param=f"lora.{field}"
        ) from None


def _words(raw: str) -> list[str]:
    """Comma- or space-separated names."""
    return [w for w in raw.replace(",", " ").split() if w]


@router.post("/policies/new")
async def create_policy_form(
    request: Request, state: StateDep, session: ConsoleAdmin, form: CheckedForm
) -> Response:
    """Create the policy (303 back to the form with a notice), or show the form again
    with the API's error and status (400 bad input, 409 taken)."""
    values = {f: str(form.get(f) or "").strip()[:500] for f in FIELDS}
    try:
        lora: dict[str, Any] = {}
        for field, kind in (("rank", int), ("alpha", float)):
            number = _number(form, field, kind)
            if number is not None:
                lora[field] = number
        if values["target_modules"]:
            lora["target_modules"] = _words(values["target_modules"])
        if lora:
            lora = lora_over_default(state.config, lora)
        record = await create_policy(
            state,
            values["name"],
            lora or None,
            _words(values["model_names"]),
            _words(values["roles"]),
        )
    except OpenAIError as exc:
        return _form_page(request, session, state, values=values, error=exc)
    return RedirectResponse(f"/console/policies/new?created={record.name}", status_code=303)


async def _page_with_error(
    request: Request, state: StateDep, session: ConsoleSession, name: str, error: OpenAIError
) -> Response:
    """Policy `name`'s page with the API's refusal on it (and its status); the not-found
    page for a name that is no policy."""
    page = await asyncio.to_thread(policy_page, state, name)
    if page is None:
        what = f"policy {name}"
        return render(request, "not_found.html", session, status=404, nav="policies", what=what)
    return render(
        request, "policy.html", session, status=error.status, nav="policies", p=page, error=error
    )


@router.post("/policies/{name}/roles")
async def set_roles_form(
    request: Request, state: StateDep, session: ConsoleAdmin, form: CheckedForm, name: str
) -> Response:
    """Set a runtime policy's roles (303 back to its page), or its page with the API's
    error (400 bad roles, 409 a config-declared policy)."""
    try:
        await set_policy_roles(state, name, _words(str(form.get("roles") or "")[:2000]))
    except OpenAIError as exc:
        return await _page_with_error(request, state, session, name, exc)
    return RedirectResponse(f"/console/policies/{name}?saved=roles", status_code=303)


@router.post("/policies/{name}/delete")
async def delete_policy_form(
    request: Request, state: StateDep, session: ConsoleAdmin, form: CheckedForm, name: str
) -> Response:
    """Delete a runtime policy (303 to the Policies list, which names it), or its page
    with the API's refusal (409 `default`, a config-declared policy or another's role)."""
    try:
        dropped = await delete_policy(state, name)
    except OpenAIError as exc:
        return await _page_with_error(request, state, session, name, exc)
    return RedirectResponse(f"/console/policies?deleted={name}&dropped={dropped}", status_code=303)
