"""The wire rooms' routes together: the hot-route table (`gateway.hotpath.HotRoutes`
serves it) and their `/openapi.json` declarations. Each room exports its own
`HOT_ROUTES` (path -> (metrics label, handler[, error body])) and `docs_router`."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.hotpath import Route
from gateway.wires.anthropic import routes as anthropic
from gateway.wires.chat import routes as chat
from gateway.wires.responses import routes as responses

HOT_ROUTES: dict[str, Route] = {
    **chat.HOT_ROUTES,
    **responses.HOT_ROUTES,
    **anthropic.HOT_ROUTES,
}
"""Every wire's hot routes, served by `gateway.hotpath.HotRoutes` outside FastAPI."""

docs_router = APIRouter()
"""The hot routes as `/openapi.json` documents them (never reached)."""
for _room in (anthropic, chat, responses):
    docs_router.include_router(_room.docs_router)
