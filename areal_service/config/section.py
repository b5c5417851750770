"""The base of every config section: unknown keys are errors, and each field's docstring
is its documentation (`scripts/config_reference.py` renders docs/config.md from them)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A section of the config tree."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
