"""One PPO training step over packed micro-batches: (optional) proximal recompute,
token-weighted gradient accumulation, grad-norm clip, AdamW step, step metrics.

Gradient accumulation: each micro-batch's loss is sum_t(...) / N_global * world_size,
with N_global the trained tokens of the minibatch over all ranks. Summed over
micro-batches and averaged over ranks by FSDP's reduce-scatter, the gradient is that
of the token-level mean over the whole minibatch, however the tokens were split.
Every rank must pass the same number of micro-batches (FSDP collectives run per
forward/backward). Touches no store and no weights directory.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from areal_service.config import TrainerConfig
from trainer.batch import MicroBatch
from trainer.loss import LOSS_KNOBS, LossStats, ppo_loss, token_logprobs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    """Metrics of one train_step (all ranks, all minibatches)."""

    loss: float
    """Token-mean loss, averaged over minibatches."""
    grad_norm: float
    """Pre-clip global grad norm, averaged over minibatches."""
    importance_weight: float
    clip_ratio: float
    capped_ratio: float
    approx_kl: float
    ref_kl: float
    """Mean k3 KL(pi_theta || pi_ref) per trained token, before each update (0 without
    a reference model)."""
    entropy: float
    n_tokens: int
    """Trained tokens, all ranks."""
    n_input_tokens: int
    """Tokens through the forward pass (prompt included), all ranks."""
    tokens_per_s: float
    """n_input_tokens / wall time of the step (forward, backward and optimizer)."""
    n_minibatches: int
    skipped_steps: int
    """Optimizer steps skipped because the grad norm was not finite."""
    mismatch_kl: float = 0.0
    """Mean k3 KL(pi_behave || pi_prox) per trained token: the train-inference mismatch
    (plus the policy's own drift since the tokens were generated)."""
    mismatch_masked_ratio: float = 0.0
    """Share of trained tokens `trainer.mismatch_mask` took out."""


def build_optimizer(model: torch.nn.Module, cfg: TrainerConfig) -> torch.optim.AdamW:
    """AdamW over every trainable parameter (after apply_fsdp2: over the local shards)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def forward_logprobs(model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) of the micro-batch's targets, both (K,) float32."""
    device = mb.input_ids.device
    cu = torch.tensor((0, *itertools.accumulate(mb.seq_lens)), dtype=torch.int32, device=device)
    longest = max(mb.seq_lens)
    out = model(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        use_cache=False,  # a cache disables the packed-sequence mask (see batch.py)
        logits_to_keep=mb.logit_index,
        # The sequences' boundaries, for attention within each (flash attention's
        # varlen keywords; trainer/packed_attention.py reads the same)
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=longest,
        max_length_k=longest,
    )
    return token_logprobs(out.logits[0], mb.targets, mb.temperature)


@torch.no_grad()
def compute_logprobs(
    model: torch.nn.Module, micro_batches: Sequence[MicroBatch]
) -> list[torch.Tensor]:
    """logp of every micro-batch's targets without grad (pi_prox or a reference model).

    FSDP2 keeps the root's parameters (embeddings, lm_head) gathered after a forward,
    expecting a backward; none follows here, so they are resharded at the end (for a
    reference model that is otherwise a full copy of its largest tensors held between
    steps)."""
    out = [forward_logprobs(model, mb)[0] for mb in micro_batches]
    reshard = getattr(model, "reshard", None)  # FSDPModule; absent on a plain module
    if reshard is not None:
        reshard()
    return out


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def token_sequence_ids(mb: MicroBatch) -> torch.Tensor:
    """(K,) the packed sequence (0-based, row order) each trained token belongs to."""
    ends = torch.tensor(mb.seq_lens, device=mb.logit_index.device).cumsum(0)
    return torch.searchsorted(ends, mb.logit_index + 1, right=True)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def accumulate_gradients(
    model: torch.nn.Module, micro_batches: Sequence[MicroBatch], cfg: TrainerConfig
) -> tuple[float, LossStats]:
    """Forward + backward every micro-batch into `.grad` (not zeroed here). Returns the
    token-mean loss over all ranks and the summed LossStats (reduced over ranks)."""
    if not micro_batches:
        raise ValueError("accumulate_gradients needs at least one micro-batch")
    device = micro_batches[0].input_ids.device
    n_local = torch.tensor(float(sum(mb.n_tokens for mb in micro_batches)), device=device)
    n_global = _all_reduce_sum(n_local.clone()).clamp(min=1.0)
    scale = _world_size()  # FSDP averages gradients over ranks; undo it for a token mean
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    stats: LossStats | None = None
    last = len(micro_batches) - 1
    knobs = cfg.model_dump(include=LOSS_KNOBS)  # the loss's settings, under their own names
    for i, mb in enumerate(micro_batches):
        if not cfg.grad_sync_every_mb:  # every rank has as many micro-batches (FSDP)
            _set_gradient_sync(model, i == last)
        logp, entropy = forward_logprobs(model, mb)
        loss, mb_stats = ppo_loss(
            logp,
            logp.detach() if mb.prox_logprobs is None else mb.prox_logprobs,
            mb.behave_logprobs,
            mb.advantages,
            ref_logp=mb.ref_logprobs,
            entropy=entropy,
            normalizer=n_global,
            seq_ids=token_sequence_ids(mb) if cfg.mismatch_mask == "sequence" else None,
            **knobs,
        )
        (loss * scale).backward()
        loss_sum += loss.detach()
        stats = mb_stats if stats is None else stats + mb_stats
    assert stats is not None
    reduced = _all_reduce_sum(torch.cat([loss_sum[None], stats.vector()]))
    return float(reduced[0]), LossStats.from_vector(reduced[1:])


def _set_gradient_sync(model: torch.nn.Module, on: bool) -> None:
    """FSDP2's reduce-scatter after this backward on or off (a plain module: no-op)."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(on)


def _optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainerConfig
) -> float:
    """Clip, step (skipped when the norm is not finite), zero grads. Returns the norm."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
        norm = norm.full_tensor()
    grad_norm = float(norm)
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        log.warning("grad norm is %s: optimizer step skipped", grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[MicroBatch],
    cfg: TrainerConfig,
    *,
    ref_model: torch.nn.Module | None = None,
) -> StepStats:
    """One training batch: cfg.ppo_minibatches optimizer steps over `micro_batches`.

    With more than one minibatch, pi_prox is recomputed for the whole batch (no grad)
    before the first update, and micro-batches are dealt round-robin to minibatches;
    with one, pi_prox is logp_theta detached (ratio 1; only w and the advantage act).
    With cfg.kl_coef > 0, reference logprobs come from `ref_model`, computed first over
    the same packed micro-batches (or the caller fills MicroBatch.ref_logprobs); a
    missing reference is an error, not a silently absent KL term. Micro-batches must
    already be on the model's device.
    """
    start = time.perf_counter()
    mbs = list(micro_batches)
    if not mbs:
        raise ValueError("train_step needs at least one micro-batch")
    if cfg.kl_coef > 0 and ref_model is not None:
        ref = compute_logprobs(ref_model, mbs)
        mbs = [replace(mb, ref_logprobs=lp) for mb, lp in zip(mbs, ref, strict=True)]
    elif cfg.kl_coef > 0 and any(mb.ref_logprobs is None for mb in mbs):
        raise ValueError("trainer.kl_coef > 0 needs a ref_model or MicroBatch.ref_logprobs")
    k = min(cfg.ppo_minibatches, len(mbs))
    if k > 1:
        prox = compute_logprobs(model, mbs)  # one pi_prox for the whole batch
        mbs = [replace(mb, prox_logprobs=lp) for mb, lp in zip(mbs, prox, strict=True)]
    losses, norms, total, skipped = [], [], None, 0
    for i in range(k):
        loss, stats = accumulate_gradients(model, mbs[i::k], cfg)
        norm = _optimizer_step(model, optimizer, cfg)
        losses.append(loss)
        norms.append(norm)
        skipped += not math.isfinite(norm)
        total = stats if total is None else total + stats
    assert total is not None
    n_input_local = float(sum(mb.n_input_tokens for mb in mbs))
    n_input = int(_all_reduce_sum(torch.tensor(n_input_local, device=mbs[0].input_ids.device)))
    elapsed = time.perf_counter() - start
    return StepStats(
        **asdict(total.summary()),  # the loss's per-token means, under the same names
        loss=sum(losses) / k,
        grad_norm=sum(norms) / k,
        n_input_tokens=n_input,
        tokens_per_s=n_input / elapsed if elapsed > 0 else 0.0,
        n_minibatches=k,
        skipped_steps=skipped,
    )
