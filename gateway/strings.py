"""Strings no store column takes: refused at the edge with 400, the same on SQLite and
PostgreSQL.

PostgreSQL's text type cannot hold a NUL character (psycopg refuses it: a 500 where
SQLite stored it), so a NUL in a request (a JSON string or key, a query parameter, a
form field) is 400 `invalid_characters` on every backend, except in a conversation's
text on the generation routes (see `check_json_body`). The check costs
one scan of the raw bytes for the JSON escape `\\u0000` (a literal NUL is not valid
JSON); only a body that has one is walked, to tell a real NUL from an escaped backslash
followed by `u0000`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from gateway.errors import OpenAIError, bad_request


def nul_refused(where: str) -> OpenAIError:
    """400 for a NUL character in `where`."""
    return bad_request(
        f"{where} contains a NUL character (\\u0000), which this gateway does not accept",
        code="invalid_characters",
    )


def has_nul(value: Any) -> bool:
    """Whether any string in `value` (nested dicts and lists, keys included) has a NUL."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False


def check_json_body(raw: bytes, body: Any, *, text_fields: Collection[str] = ()) -> None:
    """400 when the parsed JSON `body` (read from `raw`) holds a NUL character outside
    the top-level `text_fields`: a conversation's text may hold one (models emit NUL
    bytes, and an agent sends their output back as history); it is stored as JSON, which
    takes it on every backend. Everything else (model, metadata, ids) may reach a text
    column."""
    if b"\\u0000" not in raw:
        return
    if not text_fields:
        if has_nul(body):
            raise nul_refused("the request body")
        return
    for field, value in body.items():
        if field not in text_fields and has_nul([field, value]):
            raise nul_refused(f"`{field}`")
