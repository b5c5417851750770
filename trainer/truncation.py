"""What a truncated output (no EOS: the generation hit its token limit) is trained as:
`trainer.no_eos`, and DAPO's soft overlong punishment as an option. Pure functions on
claimed groups, before the advantages; no model, no store.

  train    as any other output, with its full reward (the default: AReaL's)
  mask     a truncated sequence trains no token (DAPO's overlong filtering); its
           session's return still counts in its group's baseline
  penalty  its session's return gets `trainer.no_eos_penalty` added
Overlong shaping (DAPO, arXiv 2503.14476), when `trainer.overlong_buffer` is set: with
L_max = `trainer.overlong_max_tokens`, L_c the buffer and L a session's longest run of
generated tokens (one completion's output),
  R_len = 0 if L <= L_max - L_c;  ((L_max - L_c) - L) / L_c if L <= L_max;  -1 beyond,
added to the session's return, truncated or not.

A sequence is truncated when the last completion it trains hit its token limit
(`finish_reason: "length"`, `TrainSequence.truncated`); a session when any of its
sequences is. Not "its last token is no EOS id": an output the client's stop string ended
(`"stop"`) has no EOS at its end and is complete.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from areal_service.config import TrainerConfig
from areal_service.types import EpisodeGroup, TrainSequence


def is_truncated(seq: TrainSequence) -> bool:
    """Whether `seq`'s last trained output hit its token limit (module docstring)."""
    return seq.truncated


def longest_output(seq: TrainSequence) -> int:
    """The longest run of consecutive trained tokens (one completion's output)."""
    best = run = 0
    for m in seq.loss_mask:
        run = run + 1 if m else 0
        best = max(best, run)
    return best


def overlong_shaping(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's R_len (module docstring)."""
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length <= max_tokens:
        return (start - length) / buffer
    return -1.0


def _session_shift(
    sequences: Sequence[TrainSequence], truncated: bool, cfg: TrainerConfig
) -> float:
    shift = cfg.no_eos_penalty if truncated and cfg.no_eos == "penalty" else 0.0
    if cfg.overlong_buffer is not None and cfg.overlong_max_tokens is not None:
        length = max((longest_output(s) for s in sequences), default=0)
        shift += overlong_shaping(length, cfg.overlong_max_tokens, cfg.overlong_buffer)
    return shift


def apply_no_eos(groups: Sequence[EpisodeGroup], cfg: TrainerConfig) -> list[EpisodeGroup]:
    """`groups` as `trainer.no_eos` and the overlong shaping train them (unchanged under
    `train` without shaping)."""
    shaping = cfg.overlong_buffer is not None and cfg.overlong_max_tokens is not None
    if cfg.no_eos == "train" and not shaping:
        return list(groups)
    out = []
    for group in groups:
        sequences: list[TrainSequence] = []
        returns: list[float] = []
        for sid, ret in zip(group.session_ids, group.session_returns, strict=True):
            mine = [s for s in group.sequences if s.session_id == sid]
            truncated = any(is_truncated(s) for s in mine)
            returns.append(ret + _session_shift(mine, truncated, cfg))
        for seq in group.sequences:
            if cfg.no_eos == "mask" and is_truncated(seq):
                seq = dataclasses.replace(seq, loss_mask=(0,) * len(seq.loss_mask))
            sequences.append(seq)
        out.append(
            dataclasses.replace(group, sequences=tuple(sequences), session_returns=tuple(returns))
        )
    return out
