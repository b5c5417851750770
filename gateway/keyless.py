"""Budgets of requests that carry no API key and send a body: what a client can make the
gateway hold (a connection, a buffer, a slot) before any credential is checked.

They are counted in two pools: the console's (the sign-in form, and the signed-in
console's form posts, which carry a cookie, not a key) and the rest (API traffic without
a key, which no route serves past its 401). Each pool takes at most
`gateway.limits.max_anonymous_requests` at once, and one client address at most
`gateway.limits.max_anonymous_per_address` of them (the address the auth throttle counts:
the TCP peer, or `x-forwarded-for` from a configured proxy). So one address's keyless
connections cannot take the admin's sign-in away (the audit: 260 keyless connections
each holding a 1-byte body kept the console at 503 for 60 s), and API traffic never
uses the console's pool. Their bodies must arrive within
`gateway.limits.anonymous_body_timeout_s` (a sign-in form is a few hundred bytes; 60 s is
for large prompts), else 408 and the connection is closed. Cost: two dict updates per
keyless request with a body; nothing for a request with a key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.types import Scope

from areal_service.config import LimitsConfig
from gateway.errors import OpenAIError

CONSOLE_PREFIX = "/console"

Ticket = tuple[str, str]
"""(pool, client address) of an admitted request: what `release` gives back."""


@dataclass
class KeylessBudget:
    """The in-flight counts of one gateway process (module docstring)."""

    in_flight: dict[str, int] = field(default_factory=dict)
    """pool -> requests being served."""
    by_address: dict[Ticket, int] = field(default_factory=dict)
    """(pool, address) -> requests being served; absent at zero."""

    def admit(self, scope: Scope, limits: LimitsConfig) -> Ticket | None:
        """Count this request (give the ticket back with `release`), or None when its pool
        or its address's share of it is full."""
        pool = "console" if scope["path"].startswith(CONSOLE_PREFIX) else "api"
        ticket = (pool, (scope.get("client") or ("unknown", 0))[0])
        if (
            self.in_flight.get(pool, 0) >= limits.max_anonymous_requests
            or self.by_address.get(ticket, 0) >= limits.max_anonymous_per_address
        ):
            return None
        self.in_flight[pool] = self.in_flight.get(pool, 0) + 1
        self.by_address[ticket] = self.by_address.get(ticket, 0) + 1
        return ticket

    def release(self, ticket: Ticket) -> None:
        """An admitted request ended."""
        self.in_flight[ticket[0]] -= 1
        left = self.by_address[ticket] - 1
        if left:
            self.by_address[ticket] = left
        else:
            del self.by_address[ticket]


def keyless_busy() -> OpenAIError:
    """503 when the request's pool, or its address's share, is full."""
    return OpenAIError(
        503,
        "too many requests without an API key in progress (from this address, or for "
        "this part of the gateway); retry later",
        type="server_error",
        code="server_busy",
        headers={"retry-after": "1"},
    )


def keyless_body_late(timeout_s: float) -> OpenAIError:
    """408 for a keyless body not complete within its deadline; the connection closes."""
    return OpenAIError(
        408,
        f"the request body was not received within {timeout_s:g} s "
        "(gateway.limits.anonymous_body_timeout_s: requests without an API key)",
        code="request_timeout",
        headers={"connection": "close"},
    )
