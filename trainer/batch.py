"""Packs TrainSequences into micro-batches: one row per micro-batch, sequences
concatenated with no padding, `position_ids` restarting at 0 for each sequence.

Attention stays inside each sequence because transformers (5.x) derives a block-diagonal
causal mask from restarting `position_ids` when `attention_mask` is None and there is no
KV cache (masking_utils.find_packed_sequence_indices; flash-attention uses the same
positions as varlen boundaries). Callers must pass `use_cache=False`: with a cache the
packed row silently attends across sequences. Logits are computed only at the positions
whose next token is trained (`logit_index`, passed as `logits_to_keep`), so prompt and
tool tokens cost no vocab projection. Pure tensors; no model, no store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from areal_service.types import TrainSequence

# The engine reports greedy (T < 1e-6) logprobs at T = 1 (SGLang semantics).
_GREEDY_T = 1e-6


@dataclass(frozen=True)
class MicroBatch:
    """One packed row. K = trained tokens; every (K,) tensor is aligned with `targets`."""

    input_ids: torch.Tensor
    """(1, L) int64: the sequences back to back."""
    position_ids: torch.Tensor
    """(1, L) int64: 0..len-1 for each sequence (this is what separates them)."""
    logit_index: torch.Tensor
    """(K,) int64: row positions t-1 whose logits predict a trained token t."""
    targets: torch.Tensor
    """(K,) int64: the trained token ids (input_ids[0, logit_index + 1])."""
    behave_logprobs: torch.Tensor
    """(K,) float32: the backend's logprobs of the targets."""
    advantages: torch.Tensor
    """(K,) float32: the advantage of each target's sequence."""
    temperature: torch.Tensor
    """(K,) float32: sampling temperature of each target's sequence."""
    seq_lens: tuple[int, ...]
    """Length of each packed sequence, in row order."""
    prox_logprobs: torch.Tensor | None = None
    """(K,) float32 pi_prox logprobs when recomputed before the update, else None."""
    ref_logprobs: torch.Tensor | None = None
    """(K,) float32 reference-model logprobs when a KL penalty is used, else None."""

    @property
    def n_tokens(self) -> int:
        """Trained tokens K."""
        return self.targets.numel()

    @property
    def n_input_tokens(self) -> int:
        """Row length L (all tokens the forward pass processes)."""
        return self.input_ids.shape[1]

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=True)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def _check(seq: TrainSequence) -> None:
    n = len(seq.input_ids)
    if not (len(seq.loss_mask) == len(seq.logprobs) == len(seq.versions) == n):
        raise ValueError(
            f"sequence of session {seq.session_id}: input_ids, loss_mask, logprobs and "
            f"versions lengths differ ({n}, {len(seq.loss_mask)}, {len(seq.logprobs)}, "
            f"{len(seq.versions)})"
        )


def _n_trained(seq: TrainSequence) -> int:
    # Position 0 has no preceding logits, so a loss_mask there cannot be trained.
    return sum(seq.loss_mask[1:])


def pack_bins(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: indices of `lengths` grouped into bins of total <= budget.
    An item longer than the budget gets a bin of its own. Deterministic (stable sort)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def _pack(seqs: Sequence[TrainSequence], advs: Sequence[float]) -> MicroBatch:
    ids: list[int] = []
    pos: list[int] = []
    index: list[int] = []
    behave: list[float] = []
    adv: list[float] = []
    temp: list[float] = []
    for seq, a in zip(seqs, advs, strict=True):
        offset = len(ids)
        t = 1.0 if seq.temperature < _GREEDY_T else seq.temperature
        ids.extend(seq.input_ids)
        pos.extend(range(len(seq.input_ids)))
        for k in range(1, len(seq.input_ids)):
            if seq.loss_mask[k]:
                index.append(offset + k - 1)
                behave.append(seq.logprobs[k])
        n = len(index) - len(adv)
        adv.extend([a] * n)
        temp.extend([t] * n)
    row = torch.tensor(ids, dtype=torch.long)[None]
    logit_index = torch.tensor(index, dtype=torch.long)
    return MicroBatch(
        input_ids=row,
        position_ids=torch.tensor(pos, dtype=torch.long)[None],
        logit_index=logit_index,
        targets=row[0, logit_index + 1],
        behave_logprobs=torch.tensor(behave, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        temperature=torch.tensor(temp, dtype=torch.float32),
        seq_lens=tuple(len(s.input_ids) for s in seqs),
    )


def build_micro_batches(
    sequences: Sequence[TrainSequence], advantages: Sequence[float], max_tokens_per_mb: int
) -> list[MicroBatch]:
    """Pack `sequences` (with one advantage each) into rows of at most
    `max_tokens_per_mb` tokens by first-fit decreasing, largest row first.

    A sequence longer than the budget gets a micro-batch of its own (never truncated,
    never split: splitting would cut the attention context). Sequences with no trained
    token are left out (they add nothing to the loss). Every trained token appears in
    exactly one micro-batch.
    """
    if len(sequences) != len(advantages):
        raise ValueError(f"{len(sequences)} sequences but {len(advantages)} advantages")
    for seq in sequences:
        _check(seq)
    kept = [i for i, s in enumerate(sequences) if _n_trained(s) > 0]
    bins = pack_bins([len(sequences[i].input_ids) for i in kept], max_tokens_per_mb)
    return [_pack([sequences[kept[j]] for j in b], [advantages[kept[j]] for j in b]) for b in bins]
