"""The admin web console served by the gateway at `/console` (server-rendered Jinja2 +
htmx, vendored static assets, admin-key sign-in with a signed cookie). Include it with
`app.include_router(console.router)`. Writes only what the admin REST API writes
(virtual keys: create, revoke); everything else is read from the store and the state."""

from gateway.console.routes import router

__all__ = ["router"]
