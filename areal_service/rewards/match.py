"""String and numeric answer matching (no sympy)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")
_SPACE = re.compile(r"\s+")


def _normalise(text: str, case_sensitive: bool) -> str:
    text = _SPACE.sub(" ", text).strip().rstrip(".")
    return text if case_sensitive else text.lower()


def exact_match(prediction: str, reference: str, *, case_sensitive: bool = False) -> bool:
    """Equality after collapsing whitespace and dropping a trailing period (and case,
    unless `case_sensitive`)."""
    return _normalise(prediction, case_sensitive) == _normalise(reference, case_sensitive)


def last_number(text: str) -> float | None:
    """The last number written in `text` (`1,234.5` reads as 1234.5), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def numeric_close(
    prediction: str, reference: str | float, *, rel_tol: float = 1e-6, abs_tol: float = 1e-6
) -> bool:
    """Whether the last number in `prediction` is within tolerance of `reference` (a
    number, or text whose last number is used: `#### 42` works)."""
    gold = reference if isinstance(reference, int | float) else last_number(str(reference))
    pred = last_number(prediction)
    if gold is None or pred is None:
        return False
    return math.isclose(pred, float(gold), rel_tol=rel_tol, abs_tol=abs_tol)


def exact_match_reward(completion: str | None, sample: Mapping[str, Any]) -> float:
    """1.0 when the completion equals `sample["answer"]` (see `exact_match`), else 0."""
    answer = sample.get("answer")
    if completion is None or answer is None:
        return 0.0
    return 1.0 if exact_match(completion, str(answer)) else 0.0


def numeric_reward(completion: str | None, sample: Mapping[str, Any]) -> float:
    """1.0 when the completion's last number matches `sample["answer"]` within
    `sample.get("rel_tol", 1e-6)` / `sample.get("abs_tol", 1e-6)`, else 0."""
    answer = sample.get("answer")
    if not completion or answer is None:
        return 0.0
    close = numeric_close(
        completion,
        answer,
        rel_tol=float(sample.get("rel_tol", 1e-6)),
        abs_tol=float(sample.get("abs_tol", 1e-6)),
    )
    return 1.0 if close else 0.0
