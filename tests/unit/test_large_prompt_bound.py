"""`LargePrompts.is_large` with a known bound on the text (the size of the JSON body it
came from): a small body skips the walk over every string; a large one is still counted;
too many messages is large whatever the bound."""

from __future__ import annotations

import json

from gateway.large_prompts import LargePrompts


def test_a_body_within_the_threshold_is_not_walked() -> None:
    prompts = LargePrompts(100, 1, 10)
    try:
        messages = [{"role": "user", "content": "é" * 60}]  # 60 characters, 120 bytes
        body = json.dumps({"messages": messages}, ensure_ascii=False).encode()
        assert len(body) > 100 and not prompts.is_large(messages, None)
        assert not prompts.is_large(messages, None, at_most=len(body))  # counted: 60
        big = [{"role": "user", "content": "x" * 101}]
        assert prompts.is_large(big, None, at_most=500)
        # The bound decides without counting: text within it can never pass the threshold.
        assert not prompts.is_large(big, None, at_most=100)
        many = [{"role": "user", "content": ""}] * 11
        assert prompts.is_large(many, None, at_most=10)
    finally:
        prompts.close()
