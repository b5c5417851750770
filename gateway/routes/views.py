"""The REST views of the store's records: a view is a pydantic model whose fields are
named as the record's attributes, so one function fills any of them."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

View = TypeVar("View", bound=BaseModel)


def record_view(view: type[View], record: object, **given: Any) -> View:
    """`view` filled from `record`'s attributes of the same names; `given` names the
    fields the record has not (or names otherwise). A field neither has keeps its
    default; one without a default fails validation, as a forgotten argument would."""
    fields = {
        name: getattr(record, name)
        for name in view.model_fields
        if name not in given and hasattr(record, name)
    }
    return view.model_validate(fields | given)
