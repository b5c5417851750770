"""Strings no store column takes: refused at the edge with 400, the same on SQLite and
PostgreSQL.

A lone UTF-16 surrogate (a JSON escape `\\ud800`..`\\udfff` without its pair) decodes
to a Python string that no UTF-8 encoder takes: the store, the tokenizer and the reply's
serializer each failed on it (500s, or a 503 `capture_failed` a client retried forever).
It is no character, so it is refused in every field of every JSON body (a conversation's
text too), 400 `invalid_characters`. The check costs one regex scan of the raw bytes for
an escape in the surrogate range; only a body that has one (an escaped emoji is a pair)
is walked, to tell a lone one from a pair and from an escaped backslash.

PostgreSQL's text type cannot hold a NUL character (psycopg refuses it: a 500 where
SQLite stored it), so a NUL in a request (a JSON string or key, a query parameter, a
form field) is 400 `invalid_characters` on every backend, except in a conversation's
text on the generation routes (see `check_json_body`). The check costs
one scan of the raw bytes for the JSON escape `\\u0000` (a literal NUL is not valid
JSON); only a body that has one is walked, to tell a real NUL from an escaped backslash
followed by `u0000`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

from gateway.errors import OpenAIError, bad_request


def nul_refused(where: str) -> OpenAIError:
    """400 for a NUL character in `where`."""
    return bad_request(
        f"{where} contains a NUL character (\\u0000), which this gateway does not accept",
        code="invalid_characters",
    )


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape in the UTF-16 surrogate range (a pair's half or a lone one)."""
_CHECKED_ESCAPE = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")
"""A NUL or surrogate escape: one scan finds both (measured: as fast as the substring
scan for NUL alone it replaced, ~1-3 ms per MB of body)."""


def surrogate_refused(where: str, param: str | None = None) -> OpenAIError:
    """400 for a lone UTF-16 surrogate in `where`."""
    return bad_request(
        f"{where} contains a lone UTF-16 surrogate (an escape in \\ud800-\\udfff without "
        "its pair), which is not text; send valid Unicode",
        param,
        "invalid_characters",
    )


def _any_string(value: Any, test: Callable[[str], bool]) -> bool:
    """Whether `test` holds for any string in `value` (nested dicts and lists, keys
    included)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if test(item):
                return True
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False


def _lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def has_nul(value: Any) -> bool:
    """Whether any string in `value` (nested dicts and lists, keys included) has a NUL."""
    return _any_string(value, lambda text: "\x00" in text)


def json_needs_check(raw: bytes) -> bool:
    """Whether the raw JSON `raw` may hold a character `check_json_body` refuses (a NUL
    or surrogate escape): a body without one needs no walk."""
    return _CHECKED_ESCAPE.search(raw) is not None


def check_surrogates(raw: bytes, body: Any) -> None:
    """400 naming the first top-level field (of an object body) whose strings hold a lone
    UTF-16 surrogate (module docstring)."""
    if _SURROGATE_ESCAPE.search(raw) is None or not _any_string(body, _lone_surrogate):
        return
    if isinstance(body, Mapping):
        for field, value in body.items():
            if _lone_surrogate(field):  # never echoed: the error's JSON could not hold it
                raise surrogate_refused("a field name of the request body")
            if _any_string(value, _lone_surrogate):
                raise surrogate_refused(f"`{field}`", field)
    raise surrogate_refused("the request body")


def check_json_body(raw: bytes, body: Any, *, text_fields: Collection[str] = ()) -> None:
    """400 when the parsed JSON `body` (read from `raw`) holds a NUL character outside
    the top-level `text_fields`: a conversation's text may hold one (models emit NUL
    bytes, and an agent sends their output back as history); it is stored as JSON, which
    takes it on every backend. Everything else (model, metadata, ids) may reach a text
    column. A lone surrogate is refused anywhere (`check_surrogates`)."""
    if not json_needs_check(raw):  # the one scan every body pays
        return
    check_surrogates(raw, body)
    if b"\\u0000" not in raw:
        return
    if not text_fields:
        if has_nul(body):
            raise nul_refused("the request body")
        return
    for field, value in body.items():
        if field not in text_fields and has_nul([field, value]):
            raise nul_refused(f"`{field}`")
