"""Per-step trainer metrics: computed from the claimed batch and the step's StepStats,
written to TensorBoard (`data_dir/runs/<run>`, or `runs/<run>-<policy>` for a named
policy: one run per policy; skipped with a warning when tensorboard is missing) and as
one readable log line with progress and ETA (prefixed `[<policy>]` for a named policy).
train.py writes the same dict to the store (`TrainStepRecord.metrics`, with its policy,
plotted by the console per policy).

Batch definitions (over every sequence of the batch unless said otherwise):
  task_reward     mean session return (what GRPO normalises), over sessions
  advantage       mean |A| of the sequences
  avg_seq_len     mean tokens per sequence (prompt + generated + tool/user tokens)
  avg_prompt_len  mean tokens before the first generated token
  no_eos_ratio    share of sequences whose last generated token is not an EOS id
  staleness_*     version being trained - oldest token version of each sequence

Step definitions (token means over the trained tokens): approx_kl is k3 KL(behave ||
theta), how far the trained policy is from what sampled; ref_kl is k3 KL(theta || ref),
the penalty's KL to the reference model (0 when trainer.kl_coef = 0).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from areal_service.types import DEFAULT_POLICY, EpisodeGroup
from trainer.step import StepStats

log = logging.getLogger(__name__)

METRIC_NAMES = (
    "task_reward",
    "advantage",
    "importance_weight",
    "clip_ratio",
    "approx_kl",
    "ref_kl",
    "entropy",
    "avg_seq_len",
    "avg_prompt_len",
    "no_eos_ratio",
    "mismatch_kl",
    "mismatch_masked_ratio",
    "staleness_mean",
    "staleness_max",
    "staleness_min",
    "tokens_per_s",
    "dropped_episodes",
    "episodes",
    "loss",
    "grad_norm",
    "time_wait_s",
    "time_train_s",
    "time_publish_s",
)
"""Always present; `time_swap_s` (of the previous version) is added once the gateway
has recorded it."""


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def batch_metrics(
    groups: Sequence[EpisodeGroup],
    advantages: Sequence[Sequence[float]],
    *,
    version: int,
) -> dict[str, float]:
    """Data metrics of one batch; `advantages` nest like `group.sequences`, `version` is
    the policy version being trained (before the step)."""
    seqs = [s for g in groups for s in g.sequences]
    lengths, prompts, no_eos, stale = [], [], [], []
    for seq in seqs:
        generated = [i for i, m in enumerate(seq.loss_mask) if m]
        lengths.append(len(seq.input_ids))
        prompts.append(generated[0] if generated else len(seq.input_ids))
        no_eos.append(float(seq.truncated))  # hit its token limit (trainer/truncation.py)
        produced = [v for v in seq.versions if v >= 0]
        stale.append(version - min(produced) if produced else 0)
    returns = [r for g in groups for r in g.session_returns]
    return {
        "task_reward": _mean(returns),
        "advantage": _mean([abs(a) for advs in advantages for a in advs]),
        "avg_seq_len": _mean(lengths),
        "avg_prompt_len": _mean(prompts),
        "no_eos_ratio": _mean(no_eos),
        "staleness_mean": _mean(stale),
        "staleness_max": float(max(stale, default=0)),
        # Negative: a token stamped with a version newer than the one trained, i.e. of
        # another policy's versions (the audit's N2); never, once tenants are isolated.
        "staleness_min": float(min(stale, default=0)),
        "episodes": float(sum(len(g.session_ids) for g in groups)),
    }


def step_metrics(stats: StepStats) -> dict[str, float]:
    """The optimizer-side metrics of a train_step (already reduced over ranks)."""
    return {
        "importance_weight": stats.importance_weight,
        "clip_ratio": stats.clip_ratio,
        "approx_kl": stats.approx_kl,
        "ref_kl": stats.ref_kl,
        "entropy": stats.entropy,
        "mismatch_kl": stats.mismatch_kl,
        "mismatch_masked_ratio": stats.mismatch_masked_ratio,
        "tokens_per_s": stats.tokens_per_s,
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
    }


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class MetricsWriter:
    """TensorBoard scalars + one log line per step. Rank 0 only."""

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int | None,
        no_eos: str = "train",
        policy: str = DEFAULT_POLICY,
    ) -> None:
        self._total = total_steps
        self._policy = policy
        """Named in each log line unless it is the default policy (several trainers, one
        per policy, may share a log); TensorBoard keeps one run directory per policy."""
        self._no_eos = no_eos
        self._created = time.monotonic()
        self._origin: int | None = None
        """The step this process started after (the ETA counts from it and `_created`)."""
        self._tb: Any = None
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard is optional
            log.warning("TensorBoard disabled (%s); metrics go to the store and the log", exc)
        else:
            self._tb = SummaryWriter(log_dir=str(run_dir))

    def write(self, step: int, version: int, metrics: dict[str, float]) -> str:
        """Record one step; returns the log line it wrote."""
        if self._tb is not None:
            for name, value in metrics.items():
                self._tb.add_scalar(f"train/{name}", value, step)
            self._tb.add_scalar("train/version", version, step)
            self._tb.flush()
        line = self._line(step, version, metrics)
        log.info("%s", line)
        return line

    def _line(self, step: int, version: int, m: dict[str, float]) -> str:
        progress = f"step {step}" + (f"/{self._total}" if self._total else "")
        if self._policy != DEFAULT_POLICY:
            progress = f"[{self._policy}] {progress}"
        eta = ""
        if self._origin is None:
            self._origin = step - 1
        if self._total:
            per_step = (time.monotonic() - self._created) / (step - self._origin)
            eta = f" | ETA {_duration(per_step * max(self._total - step, 0))}"
        swap = f" swap {m['time_swap_s']:.2f}s" if "time_swap_s" in m else ""
        return (
            f"{progress} v{version} | reward {m['task_reward']:.3f} |A| {m['advantage']:.3f} "
            f"loss {m['loss']:.4f} kl {m['approx_kl']:.4f} ref_kl {m['ref_kl']:.4f} "
            f"clip {m['clip_ratio']:.3f} "
            f"mismatch {m.get('mismatch_kl', 0.0):.4f}/{m.get('mismatch_masked_ratio', 0.0):.3f} "
            f"ent {m['entropy']:.3f} gnorm {m['grad_norm']:.3f} | "
            f"{m['episodes']:.0f} ep ({m['dropped_episodes']:.0f} dropped) "
            f"len {m['avg_seq_len']:.0f} no_eos {m['no_eos_ratio']:.2f} ({self._no_eos}) "
            f"stale {m['staleness_mean']:.1f}/{m['staleness_max']:.0f} "
            f"min {m.get('staleness_min', 0.0):.0f} | "
            f"{m['tokens_per_s']:.0f} tok/s | wait {m['time_wait_s']:.2f}s "
            f"train {m['time_train_s']:.2f}s publish {m['time_publish_s']:.2f}s{swap}{eta}"
        )

    def close(self) -> None:
        """Flush and close TensorBoard."""
        if self._tb is not None:
            self._tb.close()
