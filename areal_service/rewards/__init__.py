"""Reward functions for verifiable tasks (torch-free).

A reward function takes the agent's final text and the dataset sample it answered
(`sample["answer"]` holds the reference) and returns a float; it may be async. The
dataset driver calls one for single-turn data; agents may call them directly.

- `math_reward`: `math-verify` equivalence (boxed answers, GSM8K `#### 42`, fractions,
  LaTeX, thousands separators).
- `exact_match_reward`: normalised string equality.
- `numeric_reward`: the last number in the text within a tolerance of the answer.
- `load_reward`: a built-in by name (`math`, `exact_match`, `numeric`) or any function by
  import path (`package.module:function`).
"""

from areal_service.rewards.loader import BUILTIN_REWARDS, RewardFn, import_callable, load_reward
from areal_service.rewards.match import (
    exact_match,
    exact_match_reward,
    last_number,
    numeric_close,
    numeric_reward,
)
from areal_service.rewards.math import gsm8k_answer, math_equal, math_reward

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFn",
    "exact_match",
    "exact_match_reward",
    "gsm8k_answer",
    "import_callable",
    "last_number",
    "load_reward",
    "math_equal",
    "math_reward",
    "numeric_close",
    "numeric_reward",
]
