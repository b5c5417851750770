"""Math answer checking with `math-verify` (symbolic equivalence via sympy).

The reference may be a bare value (`42`, `\\frac{1}{2}`, `0.5`), a boxed answer, or a
whole GSM8K solution ending in `#### 42` (only the part after the last `####` counts).
The prediction is free text: a `#### x` tail wins, else math-verify extracts the boxed
answer or the last expression. Parsing is bounded by math-verify's SIGALRM timeout in
the main thread; elsewhere signals are unavailable, so it runs unbounded there (the
inputs are single answers, parsed in milliseconds).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

PARSE_TIMEOUT_S = 5
"""math-verify's per-call timeout (main thread only)."""


def gsm8k_answer(text: str) -> str | None:
    """The text after the last `####` (GSM8K's final-answer marker), thousands separators
    removed; None when there is no marker."""
    head, sep, tail = text.rpartition("####")
    if not sep:
        return None
    del head
    return tail.strip().replace(",", "").rstrip(".") or None


def _timeout() -> int | None:
    return PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def math_equal(prediction: str, reference: str) -> bool:
    """Whether `prediction` states an answer mathematically equal to `reference`."""
    from math_verify import parse, verify  # sympy import: ~1 s, paid on first use

    timeout = _timeout()
    gold_text = gsm8k_answer(reference) or reference
    pred_text = gsm8k_answer(prediction) or prediction
    try:
        gold = parse(gold_text, parsing_timeout=timeout)
        pred = parse(pred_text, parsing_timeout=timeout)
        if not gold or not pred:
            return False
        return bool(verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - a malformed answer is a wrong answer, never a crash
        log.debug(
            "math-verify failed on %r vs %r", prediction[:200], reference[:200], exc_info=True
        )
        return False


def math_reward(completion: str | None, sample: Mapping[str, Any]) -> float:
    """1.0 when the completion's answer equals `sample["answer"]` (math-verify), else 0."""
    answer = sample.get("answer")
    if not completion or answer is None:
        return 0.0
    return 1.0 if math_equal(completion, str(answer)) else 0.0
