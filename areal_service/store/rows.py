"""Row <-> record conversion for the store's queries (the records of `types.py`, the
rows of `schema.py`) and the shared paging rule. Column attributes carry the record's
field names, except `metadata` (reserved by SQLAlchemy declarative), which is the
attribute `meta`. Token arrays are packed blobs (`packing.py`).
"""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import Any, TypeVar

from sqlalchemy.sql import Select

from areal_service.packing import unpack_float32, unpack_int32
from areal_service.store.schema import Base
from areal_service.types import CompletionRecord

_R = TypeVar("_R")
_UNPACK = {
    "prompt_ids": unpack_int32,
    "output_ids": unpack_int32,
    "output_logprobs": unpack_float32,
    "output_versions": unpack_int32,
}
"""The packed array columns of `completions` and how each is read back."""


def _attr(field_name: str) -> str:
    return "meta" if field_name == "metadata" else field_name


@functools.cache
def _names(cls: type) -> tuple[str, ...]:
    """Field names of a record class (`dataclasses.fields` costs µs per call, and the
    writer converts every completion)."""
    return tuple(f.name for f in fields(cls))


def row_values(record: Any) -> dict[str, Any]:
    """A record's fields as ORM constructor keywords."""
    # ignore: mypy checks a class object against Hashable with the instances' unbound
    # __hash__ and rejects it; classes are hashable.
    return {_attr(name): getattr(record, name) for name in _names(type(record))}  # type: ignore[arg-type]


def to_record(cls: type[_R], row: Base) -> _R:
    """The record of class `cls` for an ORM row."""
    return cls(**{name: getattr(row, _attr(name)) for name in _names(cls)})  # type: ignore[arg-type]


def record_from_row(cls: type[_R], row: Any) -> _R:
    """The record of class `cls` for a Core row (columns under their SQL names)."""
    return cls(**{name: getattr(row, name) for name in _names(cls)})  # type: ignore[arg-type]


def completion_from_row(row: Any, **given: Any) -> CompletionRecord:
    """A record from an ORM row or a Core row; `given` supplies fields not selected."""
    values = {
        name: given[name] if name in given else getattr(row, name)
        for name in _names(CompletionRecord)
    }
    for name, unpack in _UNPACK.items():
        values[name] = unpack(values[name])
    return CompletionRecord(**values)


def where_equal(statement: Select[Any], *given: tuple[Any, object]) -> Select[Any]:
    """`statement` restricted to rows whose column equals each (column, value) pair's
    value; a None value restricts nothing (a filter the caller left out)."""
    return statement.where(*(column == value for column, value in given if value is not None))


def paged(statement: Select[Any], limit: int, offset: int) -> Select[Any]:
    """`statement` limited to one page (ValueError on a negative limit or offset)."""
    if limit < 0 or offset < 0:
        raise ValueError(f"limit ({limit}) and offset ({offset}) must be >= 0")
    return statement.limit(limit).offset(offset)
