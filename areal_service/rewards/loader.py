"""Resolve a reward function (or any callable) from config: a built-in name or an
import path `package.module:function` (`package.module.function` also works)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

RewardFn = Callable[[str | None, Mapping[str, Any]], float | Awaitable[float]]
"""`fn(completion_text, sample) -> reward` (sync or async)."""

BUILTIN_REWARDS: dict[str, str] = {
    "math": "areal_service.rewards.math:math_reward",
    "exact_match": "areal_service.rewards.match:exact_match_reward",
    "numeric": "areal_service.rewards.match:numeric_reward",
}


def import_callable(path: str) -> Callable[..., Any]:
    """The object at `module:attr` (dotted attributes allowed after the colon). The
    current directory is importable, as with `python -m`, so project-local modules
    (`examples.math.agent:run`) resolve without installing them."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path like 'package.module:function'")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} (from {path!r}): {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ValueError(f"{module_name!r} has no attribute {attr!r}") from exc
    if not callable(obj):
        raise ValueError(f"{path!r} is not callable")
    return obj  # type: ignore[no-any-return]


def load_reward(spec: str) -> RewardFn:
    """A built-in reward by name (see `BUILTIN_REWARDS`) or a function by import path."""
    return import_callable(BUILTIN_REWARDS.get(spec, spec))
