"""The demo's tasks and their verifiers.

- `digits` (the tiny random model): "reply with digits only". Prompts are generated
  (seeded) as varied instructions with distractor words; the reward is the fraction of
  the reply's non-space characters that are digits, so it is verifiable, dense, and
  starts well below 1 for an untrained model (about a third of the tiny tokenizer's
  tokens are numeric).
- `addition` (a real pretrained model, SmolLM2-135M-Instruct): "What is 3 + 7? Answer
  with the number only.", rewarded 1 when the last number of the reply is the sum. The
  100 single-digit pairs are split once (seeded) into 60 trained and 40 held out; 40
  two-digit additions, never trained, show whether anything carried over. The
  untrained model is partly right (about half of the held-out questions, greedy), so
  GRPO groups hold both rewards and there is something to learn.

A group (GRPO) is several sessions answering the same prompt.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areal_service.rewards import numeric_reward

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
    """One task instance: the user message of the episode, and its answer if it has one."""

    task_id: str
    text: str
    answer: str | None = None


@dataclass(frozen=True)
class EvalSet:
    """Prompts scored before and after training, greedy and/or sampled."""

    name: str
    prompts: list[DemoPrompt]
    temperature: float = 0.0
    """Of the headline score (0: greedy accuracy)."""
    sampled: int = 0
    """Also: samples per prompt at temperature 1 for pass@1 (0: none)."""

    @property
    def metric(self) -> str:
        """What the headline score is called."""
        return "greedy" if self.temperature == 0 else f"reward (T={self.temperature:g})"


@dataclass(frozen=True)
class DemoTask:
    """What the demo trains on and how it is scored."""

    name: str
    train: list[DemoPrompt]
    evals: list[EvalSet]
    reward: Callable[[DemoPrompt, str | None], float]
    max_tokens: int
    trainer: dict[str, Any] = field(default_factory=dict)
    """Trainer settings for this task (on top of the demo's)."""
    target: float = 0.9
    """What the headline metric (greedy accuracy on the first eval set) should reach."""


def make_prompts(n: int, seed: int = 0) -> list[DemoPrompt]:
    """`n` deterministic digits-only prompts."""
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


def digits_task() -> DemoTask:
    """The tiny model's task: its reward is dense, its eval the same kind of prompts."""
    return DemoTask(
        name="digits",
        train=make_prompts(512, seed=2),
        evals=[EvalSet("held-out prompts", make_prompts(128, seed=1), temperature=1.0)],
        reward=lambda _prompt, reply: digits_reward(reply),
        max_tokens=8,
        trainer={"lr": 2e-3, "group_size": 8, "batch_groups": 4},
        target=0.9,
    )


def addition_question(a: int, b: int) -> DemoPrompt:
    """One addition question with its answer."""
    return DemoPrompt(
        f"add-{a}-{b}", f"What is {a} + {b}? Answer with the number only.", str(a + b)
    )


def answer_reward(prompt: DemoPrompt, reply: str | None) -> float:
    """1 when the reply's last number equals the prompt's answer (`numeric` reward)."""
    return numeric_reward(reply, {"answer": prompt.answer})


def addition_task(seed: int = 0) -> DemoTask:
    """Single-digit additions, 60 trained and 40 held out, plus 40 two-digit ones never
    trained. Settings from the run that took SmolLM2-135M from 0.475 to 1.000 held-out
    greedy accuracy on 2 CPU cores: lr 1e-5, groups of 4."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    train = [addition_question(a, b) for a, b in pairs[:60]]
    held_out = [addition_question(a, b) for a, b in pairs[60:]]
    rng = random.Random(seed + 1)
    two_digit = [addition_question(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(40)]
    return DemoTask(
        name="addition",
        train=train,
        evals=[
            EvalSet("single-digit, held out", held_out, sampled=4),
            EvalSet("two-digit, never trained", two_digit),
        ],
        reward=answer_reward,
        max_tokens=16,
        trainer={"lr": 1e-5, "group_size": 4, "batch_groups": 4},
        target=0.9,
    )
