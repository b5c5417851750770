"""Console sign-in: a signed session cookie and per-session CSRF tokens (stdlib only).

Cookie value `role.issued.nonce.sig`, sig = HMAC-SHA256(secret, "role.issued.nonce"),
secret = HMAC-SHA256(admin key, "areal-console-session"): rotating the admin key signs
everyone out. Role `anon` is the pre-login cookie (it carries the login form's CSRF
nonce); only `admin` opens pages. CSRF token = HMAC(secret, "csrf." + nonce): bound to
one cookie, checked on every POST. Session and virtual keys never sign in: the login
form compares against the admin key only.

Sign-out revokes server-side, on every gateway process that shares the store (workers,
replicas): the cookie's nonce goes into the store (`console_revocations`), which every
admin page request checks (one primary-key read), and into a `RevokedSessions` set held
by the app, so the process that served the sign-out needs no read. Both keep the nonce
until the cookie would have expired anyway (`MAX_AGE_S`): bounded by the sign-outs of
the last 12 hours. Rotating the admin key signs everyone out everywhere.

Anything a client sends (cookie, CSRF field) is compared as bytes after an ASCII check:
`hmac.compare_digest` raises TypeError on non-ASCII `str`, which was a 500.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import Depends, HTTPException, Request, Response
from pydantic import SecretStr
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


def issue_cookie(
    admin_key: str, role: Role, *, now: float | None = None
) -> tuple[str, ConsoleSession]:
    """A fresh cookie value (new nonce, so a login never reuses the pre-login CSRF token)."""
    session = ConsoleSession(
        role, int(time.time() if now is None else now), secrets.token_urlsafe(16)
    )
    payload = f"{session.role}.{session.issued_at}.{session.nonce}"
    return f"{payload}.{_sign(_secret(admin_key), payload)}", session


def _same(given: str, expected: str) -> bool:
    """Constant-time equality of a client-sent string and an ASCII expected one; False
    (never TypeError) for non-ASCII input."""
    return given.isascii() and hmac.compare_digest(given.encode(), expected.encode())


def read_cookie(
    admin_key: str, value: str | None, *, now: float | None = None
) -> ConsoleSession | None:
    """The session a cookie value carries, or None when absent, forged, non-ASCII or
    expired."""
    if not value or not value.isascii() or value.count(".") != 3:
        return None
    role, issued, nonce, sig = value.split(".")
    if not _same(sig, _sign(_secret(admin_key), f"{role}.{issued}.{nonce}")):
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


def csrf_matches(admin_key: str, session: ConsoleSession, given: object) -> bool:
    """Whether a posted form field is `session`'s CSRF token (False for a missing,
    non-string or non-ASCII value)."""
    return isinstance(given, str) and _same(given, csrf_token(admin_key, session))


def revocation_expiry(session: ConsoleSession) -> float:
    """When a sign-out of `session` may be forgotten: its cookie is refused by then."""
    return session.issued_at + MAX_AGE_S + 60


class RevokedSessions:
    """Nonces of signed-out cookies, each kept until its cookie expires anyway.

    Bounded: an entry lives at most `MAX_AGE_S`; past `max_entries` (only the admin can
    sign out, so this takes a deliberate flood) the entries nearest their expiry go
    first."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self._expires: dict[str, float] = {}
        self._max_entries = max_entries

    def revoke(self, session: ConsoleSession, *, now: float | None = None) -> None:
        """Refuse `session`'s cookie from now on."""
        now = time.time() if now is None else now
        self._expires = {n: t for n, t in self._expires.items() if t > now}
        if len(self._expires) >= self._max_entries:
            keep = sorted(self._expires.items(), key=lambda item: item[1])
            self._expires = dict(keep[len(keep) - self._max_entries + 1 :])
        self._expires[session.nonce] = revocation_expiry(session)

    def __contains__(self, session: ConsoleSession) -> bool:
        return session.nonce in self._expires

    def __len__(self) -> int:
        return len(self._expires)


def set_cookie(response: Response, value: str, *, secure: bool) -> None:
    """Attach the session cookie: HttpOnly, SameSite=Strict, scoped to /console."""
    response.set_cookie(
        COOKIE_NAME,
        value,
        max_age=MAX_AGE_S,
        path="/console",
        httponly=True,
        samesite="strict",
        secure=secure,
    )


def clear_cookie(response: Response) -> None:
    """Drop the session cookie (logout)."""
    response.delete_cookie(COOKIE_NAME, path="/console", httponly=True, samesite="strict")


def admin_key_of(request: Request) -> str:
    """The configured admin key (the cookie secret's root)."""
    key: SecretStr = request.app.state.gateway.config.gateway.auth.admin_key  # app.state: untyped
    return key.get_secret_value()


def revoked_sessions(request: Request) -> RevokedSessions:
    """The app's set of signed-out cookies (made on first use; one per app, not a module
    singleton: tests run several apps in one process)."""
    revoked: RevokedSessions | None = getattr(request.app.state, "console_revoked", None)
    if revoked is None:
        revoked = request.app.state.console_revoked = RevokedSessions()
    return revoked


def current_session(request: Request) -> ConsoleSession | None:
    """The request's verified cookie session, if any (not one signed out)."""
    session = read_cookie(admin_key_of(request), request.cookies.get(COOKIE_NAME))
    if session is None or session in revoked_sessions(request):
        return None
    return session


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
    token (admin, virtual or session key) is never accepted here: only the cookie, and
    not one signed out on any process."""
    session = current_session(request)
    if session is None or session.role != "admin" or await _signed_out_elsewhere(request, session):
        raise _login_redirect(request)
    return session


async def _signed_out_elsewhere(request: Request, session: ConsoleSession) -> bool:
    """Whether another gateway process on the store served this cookie's sign-out."""
    store = request.app.state.gateway.store
    try:
        revoked = await asyncio.to_thread(store.coordination.console_session_revoked, session.nonce)
    except Exception as exc:  # the store down: refuse rather than open a page unchecked
        raise HTTPException(
            status_code=503,
            detail="the store is unreachable, so sign-outs cannot be checked; try again shortly",
            headers={"retry-after": "1"},
        ) from exc
    if not revoked:
        return False
    revoked_sessions(request).revoke(session)  # no store read for it here from now on
    return True


async def sign_out(request: Request, session: ConsoleSession) -> None:
    """Refuse `session`'s cookie from now on, here and on every process on the store."""
    try:  # the store first: a sign-out that failed there changed nothing, and can be retried
        await asyncio.to_thread(
            request.app.state.gateway.store.coordination.revoke_console_session,
            session.nonce,
            revocation_expiry(session),
        )
    except Exception as exc:
        raise HTTPException(
            status_code=503,
            detail="the store is unreachable, so the "
            "sign-out could not be recorded and you are still signed in; "
            "sign out again shortly",
            headers={"retry-after": "1"},
        ) from exc
    revoked_sessions(request).revoke(session)


ConsoleAdmin = Annotated[ConsoleSession, Depends(require_console_admin)]


async def checked_form(request: Request, session: ConsoleAdmin) -> FormData:
    """The posted form, after checking its CSRF token against the session (403 if not)."""
    form = await request.form()
    if not csrf_matches(admin_key_of(request), session, form.get(CSRF_FIELD)):
        raise HTTPException(
            status_code=403,
            detail="missing or invalid CSRF token; reload the page and submit the form again",
        )
    return form


CheckedForm = Annotated[FormData, Depends(checked_form)]
