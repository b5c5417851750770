"""Config mistakes as one readable line each, for people rather than for pydantic.

A `ValidationError` names locations as tuples and links to pydantic's docs; a YAML error
names `<unicode string>`. `ConfigError` carries the file (when there is one), the dotted
setting, what is wrong and, for an unknown name, the closest known one ("did you mean
`gateway`?"). It is a `ValueError`, so callers that catch config mistakes as ValueError
keep working.
"""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """A config mistake, already phrased for the person who made it."""


def yaml_error(source: Path | str, exc: yaml.YAMLError) -> ConfigError:
    """The YAML syntax error as `FILE, line L, column C: problem`."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(exc, "context", None)
    detail = f"{problem} ({context})" if context else problem
    return ConfigError(f"{source}{where}: not valid YAML: {detail}")


def _model_at(root: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model class whose fields the location `loc` indexes (None when it leaves the
    model tree, e.g. inside a dict-valued setting)."""
    model: type[BaseModel] | None = root
    annotation: object = root
    for part in loc:
        if isinstance(part, int):  # a list element: the list's item type
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = args[0] if args else None
        else:
            if model is None or part not in model.model_fields:
                return None
            annotation = model.model_fields[part].annotation
        model = _as_model(annotation)
        if model is None and not typing.get_args(annotation):
            return None
    return model


def _as_model(annotation: object) -> type[BaseModel] | None:
    """`annotation` as a model class, looking through `X | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _as_model(arg)
            if found is not None:
                return found
    return None


def _section_names(model: type[BaseModel] | None) -> list[str]:
    """`section.name` for the settings of `model`'s sections: a setting written one level
    too high (`gateway.max_request_bytes`, from before `gateway.limits`) is suggested
    where it lives."""
    if model is None:
        return []
    return [
        f"{name}.{leaf}"
        for name, field in model.model_fields.items()
        if (sub := _as_model(field.annotation)) is not None
        for leaf in sub.model_fields
    ]


def _dotted(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc)


def describe(
    exc: ValidationError,
    root: type[BaseModel],
    *,
    prefix: tuple[str, ...] = (),
    top_level: tuple[str, ...] = (),
) -> list[str]:
    """One line per error: `setting: what is wrong` (unknown names with a suggestion).
    `top_level`: names also valid at the top of the file (another model's sections)."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        name = _dotted(prefix + loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            parent = _model_at(root, loc[:-1])
            known = list(parent.model_fields) if parent is not None else []
            if len(loc) == 1:
                known += top_level
            close = difflib.get_close_matches(
                str(loc[-1]), known + _section_names(parent), n=1, cutoff=0.6
            )
            hint = (
                f"; did you mean `{_dotted(prefix + loc[:-1] + (close[0],))}`?"
                if close
                else (f"; known here: {', '.join(known)}" if known else "")
            )
            lines.append(f"`{name}` is not a setting{hint}")
            continue
        msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if err["type"] in ("missing",):
            lines.append(f"`{name}` is required")
        elif "input" in err and err["type"] not in ("value_error",) and loc:
            lines.append(f"`{name}`: {msg} (got {err['input']!r})")
        else:
            lines.append(f"`{name}`: {msg}" if loc else msg)
    return lines


def config_error(
    exc: ValidationError,
    root: type[BaseModel],
    source: Path | str | None,
    *,
    prefix: tuple[str, ...] = (),
    top_level: tuple[str, ...] = (),
) -> ConfigError:
    """`exc` as a ConfigError naming `source` (the config file, if any)."""
    where = (
        f"in {source} (or its --set / AREAL_* overrides)"
        if source
        else "in the --set / AREAL_* overrides"
    )
    lines = describe(exc, root, prefix=prefix, top_level=top_level)
    if len(lines) == 1:
        return ConfigError(f"config error {where}: {lines[0]}")
    return ConfigError(f"config errors {where}:\n" + "\n".join(f"  - {line}" for line in lines))
