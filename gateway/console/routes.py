"""The admin web console at `/console`: server-rendered Jinja2 pages, htmx partials and
one JSON endpoint for the training charts. Every page needs the signed admin cookie
(`auth.py`); every POST also needs the session's CSRF token. Data shaping lives in
`views.py` and `detail.py`; this module only maps URLs to them and renders.
"""

from __future__ import annotations

import asyncio
import math
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse
from fastapi.templating import Jinja2Templates

from areal_service.keys import admin_key_matches, new_api_key
from gateway.auth import Principal
from gateway.console import auth
from gateway.console.auth import CSRF_FIELD, CheckedForm, ConsoleAdmin, ConsoleSession
from gateway.console.detail import session_detail
from gateway.console.policies import policy_list, policy_page
from gateway.console.views import (
    SESSION_STATUSES,
    SessionFilters,
    overview,
    sessions_page,
    train_series,
    utc_day_start,
    weight_rows,
)
from gateway.deps import StateDep
from gateway.routes import admin as admin_routes

HERE = Path(__file__).parent
STATIC = (HERE / "static").resolve()
router = APIRouter(prefix="/console", include_in_schema=False)
templates = Jinja2Templates(directory=HERE / "templates")
SECURITY_HEADERS = {
    "cache-control": "no-store",
    # Scripts only from /console/static (no inline script); inline style attributes carry
    # the per-token colours. No framing, no form posts elsewhere.
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self' "
    "'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; "
    "base-uri 'none'",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
    "x-content-type-options": "nosniff",
}


def _ts(value: float | None) -> str:
    if value is None:
        return "—"
    return datetime.fromtimestamp(value, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def _num(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, int) or float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    if abs(value) >= 10 ** (digits - 1):  # 1,957 tokens/s, not 1.96e+03
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


templates.env.filters.update(ts=_ts, num=_num, dur=_dur)


def render(
    request: Request,
    name: str,
    session: ConsoleSession | None,
    *,
    status: int = 200,
    **context: Any,
) -> HTMLResponse:
    """A page with the layout's common context (CSRF token, base URL, active nav)."""
    token = auth.csrf_token(auth.admin_key_of(request), session) if session else ""
    base = str(request.base_url).rstrip("/")
    response = templates.TemplateResponse(
        request,
        name,
        {
            "csrf_field": CSRF_FIELD,
            "csrf_token": token,
            "base_url": base,
            "signed_in": session is not None and session.role == "admin",
            **context,
        },
        status_code=status,
    )
    response.headers.update(SECURITY_HEADERS)
    return response


# Static assets: served by the router (public: only vendored libraries and our CSS/JS).


@router.get("/static/{path:path}")
async def static(path: str) -> FileResponse:
    """A file under `static/`; 404 for anything outside it."""
    target = (STATIC / path).resolve()
    if not target.is_relative_to(STATIC) or not target.is_file():
        raise HTTPException(404, f"no static file {path!r}")
    return FileResponse(target, headers={"cache-control": "public, max-age=3600"})


# Sign-in.


def _safe_next(target: str | None) -> str:
    """Only same-site console paths (no open redirect to `//evil.example`)."""
    if target and target.startswith("/console") and not target.startswith("//"):
        return target
    return "/console"


@router.get("/login")
async def login_page(request: Request, next: str = "/console") -> Response:  # noqa: A002
    """The login form; signed-in admins go straight on."""
    session = auth.current_session(request)
    if session is not None and session.role == "admin":
        return RedirectResponse(_safe_next(next), status_code=303)
    value, session = auth.issue_cookie(auth.admin_key_of(request), "anon")
    response = render(request, "login.html", session, next=_safe_next(next), error="")
    auth.set_cookie(response, value, secure=request.url.scheme == "https")
    return response


@router.post("/login")
async def login(request: Request) -> Response:
    """Check the admin key (and the pre-login CSRF token); on success a fresh admin cookie."""
    admin_key = auth.admin_key_of(request)
    session = auth.current_session(request)
    form = await request.form()
    if session is None or not auth.csrf_matches(admin_key, session, form.get(CSRF_FIELD)):
        raise HTTPException(
            403,
            "missing or invalid CSRF token: enable cookies, reload the login page and try again",
        )
    key = form.get("admin_key")
    target = _safe_next(str(form.get("next") or ""))
    if not isinstance(key, str) or not admin_key_matches(key.strip(), admin_key):
        return render(
            request,
            "login.html",
            session,
            status=401,
            next=target,
            error="That is not the admin key. Session and virtual keys cannot open the console.",
        )
    value, _ = auth.issue_cookie(admin_key, "admin")
    response = RedirectResponse(target, status_code=303)
    auth.set_cookie(response, value, secure=request.url.scheme == "https")
    return response


@router.post("/logout")
async def logout(request: Request, session: ConsoleAdmin, _: CheckedForm) -> Response:
    """Revoke the session server-side (its cookie no longer opens anything on any gateway
    process, even if kept), drop the cookie and go back to the login page."""
    await auth.sign_out(request, session)
    response = RedirectResponse("/console/login", status_code=303)
    auth.clear_cookie(response)
    return response


# Overview.


async def _overview_context(request: Request, state: StateDep) -> dict[str, Any]:
    # The previous counter sample, one per app (rates are deltas between two polls).
    last: dict[str, float] | None = getattr(request.app.state, "console_rate_sample", None)
    if last is None:
        last = request.app.state.console_rate_sample = {}
    return {"o": await asyncio.to_thread(overview, state, last)}


@router.get("")
async def overview_page(request: Request, state: StateDep, session: ConsoleAdmin) -> Response:
    """Backends, weight version, rates, sessions, staleness window, last train step."""
    context = await _overview_context(request, state)
    return render(request, "overview.html", session, nav="overview", **context)


@router.get("/partials/overview")
async def overview_partial(request: Request, state: StateDep, session: ConsoleAdmin) -> Response:
    """The overview's live figures (htmx polls this every few seconds)."""
    context = await _overview_context(request, state)
    return render(request, "_overview_stats.html", session, **context)


# Sessions.


@router.get("/sessions")
async def sessions_list(
    request: Request,
    state: StateDep,
    session: ConsoleAdmin,
    status: str = "",
    group_id: str = "",
    task_id: str = "",
    key_id: str = "",
    since: str = "",
    until: str = "",
    page: int = 1,
) -> Response:
    """Sessions, filtered and paginated in the database."""
    if status and status not in SESSION_STATUSES:
        raise HTTPException(400, f"status must be one of {', '.join(SESSION_STATUSES)}")
    for day in (since, until):
        if day:
            try:
                utc_day_start(day)
            except ValueError as exc:
                raise HTTPException(400, f"dates are YYYY-MM-DD, not {day!r}") from exc
    filters = SessionFilters(
        status, group_id.strip(), task_id.strip(), key_id.strip(), since, until, max(page, 1)
    )
    listing = await asyncio.to_thread(sessions_page, state.store, filters)
    return render(
        request,
        "sessions.html",
        session,
        nav="sessions",
        listing=listing,
        statuses=SESSION_STATUSES,
    )


@router.get("/sessions/{session_id}")
async def session_page(
    request: Request, state: StateDep, session: ConsoleAdmin, session_id: str
) -> Response:
    """One episode: turn tree, messages, per-token outputs, rewards, training sequences."""
    found = await asyncio.to_thread(
        session_detail, state.store, state.config.trainer, state.tokenizer, session_id
    )
    if found is None:
        return render(
            request,
            "not_found.html",
            session,
            status=404,
            nav="sessions",
            what=f"session {session_id}",
        )
    return render(request, "session.html", session, nav="sessions", d=found)


# Keys.

KEYS_SHOWN = 500
"""Most keys on the keys page, newest first (the user's own keys are listed apart from
session keys, so they are never among those cut)."""


async def _keys_page(
    request: Request,
    state: StateDep,
    session: ConsoleSession,
    *,
    created: dict[str, Any] | None = None,
    show_session_keys: bool = False,
    status: int = 200,
) -> Response:
    # The user's own keys are asked for by kind: among one session key per session ever
    # started, a newest-N page of everything would push them out of sight.
    kinds = None if show_session_keys else ("user",)
    keys = await asyncio.to_thread(state.store.keys.list_api_keys, limit=KEYS_SHOWN, kinds=kinds)
    sessions = await asyncio.to_thread(state.store.keys.count_api_keys, kinds=("session",))
    return render(
        request,
        "keys.html",
        session,
        status=status,
        nav="keys",
        keys=keys,
        hidden=sessions,
        shown_max=KEYS_SHOWN,
        created=created,
        show_session_keys=show_session_keys,
        revoked=request.query_params.get("revoked", ""),
        limits_set=request.query_params.get("limits", ""),
    )


@router.get("/keys")
async def keys_page(
    request: Request, state: StateDep, session: ConsoleAdmin, all: bool = False
) -> Response:  # noqa: A002
    """Virtual keys (session keys on request), newest first."""
    return await _keys_page(request, state, session, show_session_keys=all)


@router.post("/keys")
async def create_key(
    request: Request, state: StateDep, session: ConsoleAdmin, form: CheckedForm
) -> Response:
    """Create a user key; the response is the only time its plaintext is shown."""
    name = str(form.get("name") or "").strip()[:200]
    plaintext, record = new_api_key(name=name)
    await asyncio.to_thread(state.store.keys.add_api_key, record)
    created = {**admin_routes.key_view(record), "api_key": plaintext}
    return await _keys_page(request, state, session, created=created, status=201)


@router.post("/keys/{key_id}/revoke")
async def revoke_key(state: StateDep, _: CheckedForm, key_id: str) -> Response:
    """Revoke a key (effective at once on this replica), then back to the list."""
    key = await asyncio.to_thread(state.store.keys.get_api_key, key_id)
    if key is None:
        raise HTTPException(404, f"no key with id {key_id!r}")
    await asyncio.to_thread(state.store.keys.revoke_api_key, key_id)
    state.keys.forget(key.key_hash)
    return RedirectResponse(f"/console/keys?revoked={key_id}", status_code=303)


@router.post("/keys/{key_id}/limits")
async def set_key_limits(state: StateDep, form: CheckedForm, key_id: str) -> Response:
    """Set a key's limits from the keys page (a blank field: unlimited)."""
    limits: dict[str, int | None] = {}
    for name in admin_routes.LIMIT_FIELDS:
        raw = str(form.get(name) or "").strip().replace(",", "").replace("_", "")
        if not raw:
            limits[name] = None
        elif raw.isascii() and raw.isdigit() and 1 <= int(raw) <= 2**53:
            limits[name] = int(raw)
        else:
            raise HTTPException(400, f"{name} must be a whole number >= 1, or blank for no limit")
    await admin_routes.apply_key_limits(state, key_id, limits)
    return RedirectResponse(f"/console/keys?limits={key_id}#key-{key_id}", status_code=303)


# Training and weights.


@router.get("/training")
async def training_page(request: Request, state: StateDep, session: ConsoleAdmin) -> Response:
    """Per-step training curves (drawn by static/training.js from `training/data.json`)."""
    steps = await asyncio.to_thread(state.store.list_train_steps, limit=100_000)
    return render(
        request,
        "training.html",
        session,
        nav="training",
        steps=steps[-20:][::-1],
        count=len(steps),
        named_policies=bool(state.policy_registry.declared),
    )


@router.get("/training/data.json")
async def training_data(state: StateDep, _: ConsoleAdmin) -> JSONResponse:
    """Chart series of every train step (re-fetched by the chart script to refresh)."""
    steps = await asyncio.to_thread(state.store.list_train_steps, limit=100_000)
    body = train_series(steps)
    body["generated_at"] = time.time()
    return JSONResponse(body, headers={"cache-control": "no-store"})


@router.get("/weights")
async def weights_page(request: Request, state: StateDep, session: ConsoleAdmin) -> Response:
    """Published weight versions with the gateway's swap timings."""
    rows = await asyncio.to_thread(weight_rows, state.store)
    return render(
        request,
        "weights.html",
        session,
        nav="weights",
        rows=rows,
        live_version=state.live_version,
        named_policies=bool(state.policy_registry.declared),
    )


# Policies.


@router.get("/policies")
async def policies_page(request: Request, state: StateDep, session: ConsoleAdmin) -> Response:
    """Every policy: aliases, LoRA rank, live and published versions, sessions, window."""
    rows = await asyncio.to_thread(policy_list, state)
    return render(
        request,
        "policies.html",
        session,
        nav="policies",
        rows=rows,
        staleness_gate=state.config.gateway.sessions.staleness_gate,
        deleted=request.query_params.get("deleted", "")[:63],
        dropped=request.query_params.get("dropped", "")[:12],
    )


def _policy_missing(request: Request, session: ConsoleSession, name: str) -> Response:
    return render(
        request, "not_found.html", session, status=404, nav="policies", what=f"policy {name}"
    )


@router.get("/policies/{name}")
async def policy_detail_page(
    request: Request, state: StateDep, session: ConsoleAdmin, name: str
) -> Response:
    """One policy: reward and loss curves, its versions with swap timings, its window."""
    page = await asyncio.to_thread(policy_page, state, name)
    if page is None:
        return _policy_missing(request, session, name)
    saved = request.query_params.get("saved", "")[:16]
    return render(request, "policy.html", session, nav="policies", p=page, saved=saved)


@router.get("/policies/{name}/data.json")
async def policy_data(state: StateDep, _: ConsoleAdmin, name: str) -> JSONResponse:
    """Chart series of the policy's train steps (as `training/data.json`)."""
    if name not in state.policy_registry:
        raise HTTPException(404, f"no policy {name!r}")
    steps = await asyncio.to_thread(state.store.list_train_steps, limit=100_000, policy=name)
    body = train_series(steps)
    body["generated_at"] = time.time()
    return JSONResponse(body, headers={"cache-control": "no-store"})


# Export.


@router.get("/export")
async def export_page(request: Request, state: StateDep, session: ConsoleAdmin) -> Response:
    """The export form (and the equivalent admin REST call)."""
    trainable = await asyncio.to_thread(
        lambda: sum(state.store.count_sessions(status=s) for s in ("ended", "claimed", "trained"))
    )
    return render(request, "export.html", session, nav="export", trainable=trainable)


@router.get("/export/download")
async def export_download(
    state: StateDep,
    _: ConsoleAdmin,
    format: str = "jsonl",  # noqa: A002
    group_id: str = "",
    task_id: str = "",
) -> Response:
    """The same stream as `GET /admin/export`, authorised by the console cookie."""
    if format not in ("jsonl", "parquet"):
        raise HTTPException(400, "format must be jsonl or parquet")
    return await admin_routes.export(
        state,
        Principal(is_admin=True),
        format=format,
        group_id=group_id.strip() or None,
        task_id=task_id.strip() or None,
    )
