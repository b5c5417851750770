"""The demo's synthetic task and its verifier: "reply with digits only".

Prompts are generated (seeded) as varied instructions with distractor words; the reward
is the fraction of the reply's non-space characters that are digits, so it is
verifiable, dense, and starts well below 1 for an untrained model (about a third of the
tiny tokenizer's tokens are numeric). A group (GRPO) is several sessions answering the
same prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_ASKS = (
    "Reply with digits only.",
    "Answer using only numbers.",
    "Write a number and nothing else.",
    "Only digits please.",
    "Give me a number.",
)
_FILLER = "apples weather city file tool answer think list value hello world step".split()


@dataclass(frozen=True, slots=True)
class DemoPrompt:
    """One task instance: the user message of the episode."""

    task_id: str
    text: str


def make_prompts(n: int, seed: int = 0) -> list[DemoPrompt]:
    """`n` deterministic prompts."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        words = " ".join(rng.choice(_FILLER) for _ in range(rng.randint(1, 4)))
        prompts.append(DemoPrompt(f"digits-{seed}-{i}", f"{rng.choice(_ASKS)} ({words})"))
    return prompts


def digits_reward(reply: str | None) -> float:
    """Fraction of non-space characters that are ASCII digits (0 for an empty reply)."""
    chars = [c for c in (reply or "") if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c in "0123456789" for c in chars) / len(chars)
