"""Admin REST: virtual keys (create: plaintext shown once; list; revoke). Admin key only."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import tempfile
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.concurrency import iterate_in_threadpool

from areal_service.export import ExportFilters, export_sequences, iter_export_rows
from areal_service.keys import new_api_key
from areal_service.types import ApiKeyRecord
from gateway.admission import window
from gateway.deps import AdminDep, StateDep, parse_model, read_json
from gateway.errors import OpenAIError

router = APIRouter(prefix="/admin")


class KeyCreate(BaseModel):
    """Body of `POST /admin/keys`."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("", max_length=200)
    metadata: dict[str, Any] = Field(default_factory=dict)


def key_view(key: ApiKeyRecord) -> dict[str, Any]:
    """A key as lists show it: never the hash or the plaintext."""
    return {"id": key.id, "name": key.name, "display": key.display, "kind": key.kind,
            "session_id": key.session_id, "created_at": key.created_at,
            "last_used_at": key.last_used_at, "revoked_at": key.revoked_at}


@router.post("/keys", status_code=201)
async def create_key(request: Request, state: StateDep, _: AdminDep) -> dict[str, Any]:
    """Create a virtual key; the response carries the plaintext, the only time it is shown."""
    body = parse_model(KeyCreate, await read_json(request, allow_empty=True))
    plaintext, record = new_api_key(name=body.name)
    record = dataclasses.replace(record, metadata=body.metadata)
    await asyncio.to_thread(state.store.add_api_key, record)
    return {**key_view(record), "api_key": plaintext}


@router.get("/keys")
async def list_keys(state: StateDep, _: AdminDep, limit: int = 100, offset: int = 0
                    ) -> dict[str, Any]:
    """Virtual keys, newest first."""
    keys = await asyncio.to_thread(state.store.list_api_keys, limit=min(limit, 1000),
                                   offset=offset)
    return {"object": "list", "data": [key_view(k) for k in keys]}


@router.post("/keys/{key_id}/revoke")
@router.delete("/keys/{key_id}")
async def revoke_key(key_id: str, state: StateDep, _: AdminDep) -> dict[str, Any]:
    """Revoke a key: later requests with it get 401 (at once on this replica)."""
    key = await asyncio.to_thread(state.store.get_api_key, key_id)
    if key is None:
        raise OpenAIError(404, f"no key with id {key_id!r}", param="key_id", code="key_not_found")
    revoked = await asyncio.to_thread(state.store.revoke_api_key, key_id)
    state.keys.forget(key.key_hash)
    assert revoked is not None
    return key_view(revoked)



@router.get("/status")
async def status(state: StateDep, _: AdminDep) -> dict[str, Any]:
    """Live weight version, backends, open sessions and the staleness window."""
    open_sessions = await asyncio.to_thread(state.store.count_sessions, status="open")
    started = await asyncio.to_thread(state.store.count_sessions)
    return {"live_version": state.live_version, "model": state.config.gateway.model_name,
            "backends": [{"url": s.url, "healthy": s.healthy, "in_flight": s.in_flight,
                          "last_error": s.last_error} for s in state.backends.status()],
            "open_sessions": open_sessions, "started_sessions": started,
            "staleness_gate": state.config.gateway.staleness_gate,
            "staleness_window": window(state, state.live_version)}


@router.get("/export")
async def export(state: StateDep, _: AdminDep, format: str = "jsonl",  # noqa: A002
                 group_id: str | None = None, task_id: str | None = None) -> Response:
    """Training sequences as JSONL (streamed page by page) or Parquet (written to a
    temporary file in a thread, then sent)."""
    filters = ExportFilters(group_id=group_id, task_id=task_id)
    trainer = state.config.trainer
    options = {"turn_discount": trainer.turn_discount,
               "default_reward": trainer.reward_default_for_unrewarded}
    if format == "jsonl":
        rows = iter_export_rows(state.store, filters, **options)
        lines = (json.dumps(row, separators=(",", ":")) + "\n" for row in rows)
        return StreamingResponse(iterate_in_threadpool(lines), media_type="application/x-ndjson",
                                 headers={"content-disposition": "attachment; filename=export.jsonl"})
    if format != "parquet":
        raise OpenAIError(400, "format must be jsonl or parquet", param="format")
    fd, path = tempfile.mkstemp(suffix=".parquet")
    os.close(fd)
    await asyncio.to_thread(export_sequences, state.store, fmt="parquet", out=path,
                            filters=filters, **options)
    return FileResponse(path, filename="export.parquet", media_type="application/octet-stream",
                        background=BackgroundTask(os.unlink, path))
