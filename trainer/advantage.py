"""Advantages from episode returns: pure functions, float64, no model, no store.

For a group g of sessions with returns r_1..r_n (n >= 1):
  grpo    A_i = (r_i - mean_g) / (std_g + eps)          std_g population (ddof=0)
  drgrpo  A_i = r_i - mean_g                             (Dr.GRPO: no std division)
  rloo    A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_g)   (n = 1: A = 0)
  batch   A_i = (r_i - mean_B) / (std_B + eps)           over every session of the batch
The std is the population std (ddof=0), not the unbiased one TRL/verl use: it is
defined for n = 1 and does not depend on the group size (ddof=1 makes n=2 advantages
1/sqrt(2) smaller). A group whose returns are all equal gets exactly 0, never NaN.
Every training sequence of a session carries that session's advantage.

Groups of one (ungrouped sessions, `trainer.ungrouped_baseline`) have nothing to be
centred on within their group, so under the group kinds they get a baseline instead:
  batch      A_i = (r_i - mean_U) / (std_U + eps)   over the step's groups of one
  task_mean  A_i = r_i - b_task                      b_task a running mean of the task's
             earlier returns (`RunningBaseline`; for a new task the running mean over
             all tasks, at the first step the step's mean)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from areal_service.config import AdvantageKind
from areal_service.types import EpisodeGroup


def _centered(returns: torch.Tensor) -> torch.Tensor:
    """r - mean(r), exactly 0 when all returns are equal (the mean can round off)."""
    if returns.numel() == 0 or bool(returns.max() == returns.min()):
        return torch.zeros_like(returns)
    return returns - returns.mean()


def grpo(returns: torch.Tensor, eps: float) -> torch.Tensor:
    """GRPO: (r_i - mean_g) / (std_g + eps), population std."""
    centered = _centered(returns)
    return centered / (centered.pow(2).mean().sqrt() + eps)


def drgrpo(returns: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: r_i - mean_g."""
    return _centered(returns)


def rloo(returns: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i - mean_{j != i} r_j, which equals n/(n-1) * (r_i - mean_g); 0 for n = 1."""
    n = returns.numel()
    if n < 2:
        return torch.zeros_like(returns)
    return _centered(returns) * (n / (n - 1))


def group_advantages(
    groups: Sequence[Sequence[float]], kind: AdvantageKind, eps: float
) -> list[list[float]]:
    """Per-session advantages for per-session returns, grouped (same nesting out as in).
    `batch` normalises over all groups together; the others within each group."""
    tensors = [torch.tensor(list(g), dtype=torch.float64) for g in groups]
    if kind == "batch":
        flat = grpo(torch.cat(tensors) if tensors else torch.zeros(0, dtype=torch.float64), eps)
        return [chunk.tolist() for chunk in flat.split([t.numel() for t in tensors])]
    if kind == "grpo":
        return [grpo(t, eps).tolist() for t in tensors]
    if kind == "drgrpo":
        return [drgrpo(t).tolist() for t in tensors]
    if kind == "rloo":
        return [rloo(t).tolist() for t in tensors]
    raise ValueError(f"unknown advantage kind {kind!r}")


class RunningBaseline:
    """Per-`task_id` exponential running mean of returns (the `task_mean` baseline), with
    a running mean over every task for a task not seen before. Kept by the trainer
    process (a restart starts again from the step means)."""

    def __init__(self, decay: float) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"decay ({decay}) must be in [0, 1)")
        self._decay = decay
        self._means: dict[str | None, float] = {}
        self._overall: float | None = None

    def mean(self, task_id: str | None) -> float | None:
        """The baseline of `task_id` now (None before its first step)."""
        return self._means.get(task_id)

    def _update(self, old: float | None, value: float) -> float:
        return value if old is None else self._decay * old + (1 - self._decay) * value

    def advantages(self, tasks: Sequence[str | None], returns: Sequence[float]) -> list[float]:
        """r_i - b for this step's returns, b the task's baseline before the step, else
        the running mean over all tasks, else this step's mean; then every baseline moves
        toward the step's means: b <- decay * b + (1 - decay) * mean."""
        if not returns:
            return []
        step: dict[str | None, list[float]] = {}
        for task, value in zip(tasks, returns, strict=True):
            step.setdefault(task, []).append(value)
        overall = self._overall if self._overall is not None else sum(returns) / len(returns)
        out = [
            value - self._means.get(task, overall)
            for task, value in zip(tasks, returns, strict=True)
        ]
        for task, values in step.items():
            self._means[task] = self._update(self._means.get(task), sum(values) / len(values))
        self._overall = self._update(self._overall, sum(returns) / len(returns))
        return out


def _one_session_advantages(
    groups: Sequence[EpisodeGroup], eps: float, baseline: RunningBaseline | None
) -> dict[int, float]:
    """Advantage of each group of one (by index in `groups`): batch-normalised over them,
    or against the running per-task baseline."""
    solo = [i for i, g in enumerate(groups) if len(g.session_returns) == 1]
    returns = [groups[i].session_returns[0] for i in solo]
    if baseline is None:
        values = grpo(torch.tensor(returns, dtype=torch.float64), eps).tolist() if solo else []
    else:
        values = baseline.advantages([groups[i].task_id for i in solo], returns)
    return dict(zip(solo, values, strict=True))


def sequence_advantages(
    groups: Sequence[EpisodeGroup],
    kind: AdvantageKind,
    eps: float,
    baseline: RunningBaseline | None = None,
) -> list[list[float]]:
    """One advantage per TrainSequence, nested like `group.sequences`: every sequence of
    a session gets that session's advantage A_s (computed from `session_returns`).

    A sequence's own return (`TrainSequence.reward`, discounted by gamma within the
    session) is deliberately not mixed in: GRPO compares sessions, and adding a
    within-session return difference scaled by 1/(std_g + eps) explodes when a group's
    returns are (nearly) equal.

    Under the group kinds, groups of one get the ungrouped baseline (module docstring):
    `baseline` for `task_mean`, None for batch normalisation over them.
    """
    per_session = group_advantages([g.session_returns for g in groups], kind, eps)
    if kind != "batch":
        for index, value in _one_session_advantages(groups, eps, baseline).items():
            per_session[index] = [value]
    out: list[list[float]] = []
    for group, advs in zip(groups, per_session, strict=True):
        by_session = dict(zip(group.session_ids, advs, strict=True))
        out.append([by_session[s.session_id] for s in group.sequences])
    return out
