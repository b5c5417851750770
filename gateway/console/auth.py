"""Console sign-in: a signed session cookie and per-session CSRF tokens (stdlib only).

Cookie value `role.issued.nonce.sig`, sig = HMAC-SHA256(secret, "role.issued.nonce"),
secret = HMAC-SHA256(admin key, "areal-console-session"): rotating the admin key signs
everyone out, and nothing is stored server-side. Role `anon` is the pre-login cookie
(it carries the login form's CSRF nonce); only `admin` opens pages. CSRF token =
HMAC(secret, "csrf." + nonce): bound to one cookie, checked on every POST. Session and
virtual keys never sign in: the login form compares against the admin key only.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import Depends, HTTPException, Request, Response
from starlette.datastructures import FormData

COOKIE_NAME = "areal_console"
CSRF_FIELD = "csrf_token"
MAX_AGE_S = 12 * 3600
"""An admin cookie older than this is refused (and the browser drops it then too)."""

Role = Literal["anon", "admin"]


@dataclass(frozen=True, slots=True)
class ConsoleSession:
    """A verified cookie: its role, issue time and CSRF nonce."""

    role: Role
    issued_at: int
    nonce: str


def _secret(admin_key: str) -> bytes:
    return hmac.new(admin_key.encode(), b"areal-console-session", hashlib.sha256).digest()


def _sign(secret: bytes, payload: str) -> str:
    return hmac.new(secret, payload.encode(), hashlib.sha256).hexdigest()


def issue_cookie(admin_key: str, role: Role, *, now: float | None = None) -> tuple[str, ConsoleSession]:
    """A fresh cookie value (new nonce, so a login never reuses the pre-login CSRF token)."""
    session = ConsoleSession(role, int(time.time() if now is None else now),
                             secrets.token_urlsafe(16))
    payload = f"{session.role}.{session.issued_at}.{session.nonce}"
    return f"{payload}.{_sign(_secret(admin_key), payload)}", session


def read_cookie(admin_key: str, value: str | None, *, now: float | None = None
                ) -> ConsoleSession | None:
    """The session a cookie value carries, or None when absent, forged or expired."""
    if not value or value.count(".") != 3:
        return None
    role, issued, nonce, sig = value.split(".")
    if not hmac.compare_digest(sig, _sign(_secret(admin_key), f"{role}.{issued}.{nonce}")):
        return None
    if role not in ("anon", "admin") or not issued.isdigit():
        return None
    age = (time.time() if now is None else now) - int(issued)
    if age > MAX_AGE_S or age < -60:
        return None
    return ConsoleSession(role, int(issued), nonce)  # type: ignore[arg-type]


def csrf_token(admin_key: str, session: ConsoleSession) -> str:
    """The CSRF token that forms posted under `session` must carry."""
    return _sign(_secret(admin_key), f"csrf.{session.nonce}")


def set_cookie(response: Response, value: str, *, secure: bool) -> None:
    """Attach the session cookie: HttpOnly, SameSite=Strict, scoped to /console."""
    response.set_cookie(COOKIE_NAME, value, max_age=MAX_AGE_S, path="/console",
                        httponly=True, samesite="strict", secure=secure)


def clear_cookie(response: Response) -> None:
    """Drop the session cookie (logout)."""
    response.delete_cookie(COOKIE_NAME, path="/console", httponly=True, samesite="strict")


def admin_key_of(request: Request) -> str:
    """The configured admin key (the cookie secret's root)."""
    return request.app.state.gateway.config.gateway.admin_key.get_secret_value()


def current_session(request: Request) -> ConsoleSession | None:
    """The request's verified cookie session, if any."""
    return read_cookie(admin_key_of(request), request.cookies.get(COOKIE_NAME))


def _login_redirect(request: Request) -> HTTPException:
    """303 to the login page (htmx requests get `HX-Redirect`, which htmx follows)."""
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    location = f"/console/login?next={quote(target, safe='')}"
    headers = {"location": location}
    if request.headers.get("hx-request"):
        headers["hx-redirect"] = location
    return HTTPException(status_code=303, detail="sign in with the admin key", headers=headers)


async def require_console_admin(request: Request) -> ConsoleSession:
    """The signed-in admin's session; otherwise a redirect to the login page. A bearer
    token (admin, virtual or session key) is never accepted here: only the cookie."""
    session = current_session(request)
    if session is None or session.role != "admin":
        raise _login_redirect(request)
    return session


ConsoleAdmin = Annotated[ConsoleSession, Depends(require_console_admin)]


async def checked_form(request: Request, session: ConsoleAdmin) -> FormData:
    """The posted form, after checking its CSRF token against the session (403 if not)."""
    form = await request.form()
    given = form.get(CSRF_FIELD)
    expected = csrf_token(admin_key_of(request), session)
    if not isinstance(given, str) or not hmac.compare_digest(given, expected):
        raise HTTPException(status_code=403, detail="missing or invalid CSRF token; reload "
                            "the page and submit the form again")
    return form


CheckedForm = Annotated[FormData, Depends(checked_form)]
