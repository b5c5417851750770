"""Decoupled PPO loss (AReaL, arXiv 2505.24298) and token logprobs from logits. Pure
tensor functions: no model, no distributed state.

Per trained token t, with A_t its sequence's advantage:
  w_t     = exp(logp_prox - logp_behave)                 behaviour weight, no gradient
  ratio_t = exp(logp_theta - logp_prox)
  pg_t    = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_clip, 1 + eps_high) * A_t)
  kl_t    = exp(logp_ref - logp_theta) - (logp_ref - logp_theta) - 1
  loss    = sum_t keep_t * w_t * pg_t / N  +  kl_coef * sum_t kl_t / N
where keep_t = [w_t <= behav_imp_weight_cap] * m_t and N is the number of trained
tokens (token-level mean). As in AReaL, a token over the cap is masked out (weight 0),
not clamped, and still counts in N: clamping would keep a gradient from a sample the
behaviour policy almost never draws.

Train-inference mismatch masking (`mismatch_mask`, interval [a, b] = [mismatch_low,
mismatch_high]); w_t is the behaviour/proximal ratio above:
  none      m_t = 1
  token     m_t = [a <= w_t <= b]                   IcePop-style token masking
  sequence  m_t = [a <= exp(mean_{u in s} log w_u) <= b]   MIS: masked importance
            sampling, the geometric-mean ratio of t's sequence s decides for all of it
A masked token is out of the policy-gradient term (its gradient is 0) and still counts
in N, like a capped one. Per step the loss reports the mismatch itself,
mismatch_kl = mean_t exp(l_t) - 1 - l_t with l_t = logp_prox - logp_behave (k3 KL of
pi_behave to pi_prox, >= 0, unbiased for tokens drawn from pi_behave), and the share of
tokens the masks took out (`mismatch_masked`).

kl_t is Schulman's k3 estimator of KL(pi_theta || pi_ref) (GRPO's and verl's
`low_var_kl`): with r = pi_ref/pi_theta at the sampled token, r - log r - 1 >= 0, and
its expectation under pi_theta is the KL exactly. Its gradient in logp_theta is
1 - r: it pulls a token's logprob down where the policy is above the reference and up
where below. It is applied to every trained token (capped ones included: the penalty
keeps the policy near pi_ref whatever the behaviour weight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from areal_service.config import MismatchMask

# Rows per chunk of the entropy pass: bounds its extra memory to 1024 x vocab floats.
_ENTROPY_CHUNK = 1024


@dataclass(frozen=True)
class LossStats:
    """Token sums of one loss call, detached 0-d tensors on the loss's device (no host
    sync). Add them over micro-batches and ranks, then read `summary()`."""

    n_tokens: torch.Tensor
    """Trained tokens (the loss's N when no normalizer is given)."""
    importance_weight: torch.Tensor
    """Sum of w over kept (uncapped) tokens."""
    clipped: torch.Tensor
    """Tokens where the clipped branch is active (their gradient is 0)."""
    capped: torch.Tensor
    """Tokens masked out by behav_imp_weight_cap."""
    approx_kl: torch.Tensor
    """Sum of k3 KL(behave || theta) = exp(d) - 1 - d, d = logp_theta - logp_behave
    (unbiased for samples drawn from the behaviour policy, always >= 0)."""
    ref_kl: torch.Tensor
    """Sum of kl_t, the k3 KL(theta || ref) of the penalty (0 without reference
    logprobs)."""
    entropy: torch.Tensor
    """Sum of the entropy of pi_theta(. / T) (0 when no entropy was given)."""
    mismatch_kl: torch.Tensor
    """Sum of k3 KL(behave || prox) = exp(l) - 1 - l, l = logp_prox - logp_behave."""
    mismatch_masked: torch.Tensor
    """Tokens the mismatch mask took out (and the cap did not)."""

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats.from_vector(self.vector() + other.vector())

    def vector(self) -> torch.Tensor:
        """The nine sums as one float64 vector (for a single all_reduce)."""
        parts = (
            self.n_tokens,
            self.importance_weight,
            self.clipped,
            self.capped,
            self.approx_kl,
            self.ref_kl,
            self.entropy,
            self.mismatch_kl,
            self.mismatch_masked,
        )
        return torch.stack([p.to(torch.float64) for p in parts])

    @classmethod
    def from_vector(cls, v: torch.Tensor) -> LossStats:
        return cls(*v.unbind())

    def summary(self) -> LossSummary:
        """Means per token (one host sync)."""
        n, w, clipped, capped, kl, ref_kl, ent, mkl, masked = self.vector().tolist()
        kept = n - capped - masked
        return LossSummary(
            n_tokens=int(n),
            importance_weight=w / kept if kept else 0.0,
            clip_ratio=clipped / n if n else 0.0,
            capped_ratio=capped / n if n else 0.0,
            approx_kl=kl / n if n else 0.0,
            ref_kl=ref_kl / n if n else 0.0,
            entropy=ent / n if n else 0.0,
            mismatch_kl=mkl / n if n else 0.0,
            mismatch_masked_ratio=masked / n if n else 0.0,
        )


@dataclass(frozen=True)
class LossSummary:
    """Per-token means of LossStats."""

    n_tokens: int
    importance_weight: float
    """Mean w over kept tokens (neither capped nor mismatch-masked)."""
    clip_ratio: float
    capped_ratio: float
    approx_kl: float
    ref_kl: float
    """Mean kl_t: the KL(pi_theta || pi_ref) estimate of the penalty."""
    entropy: float
    mismatch_kl: float = 0.0
    """Mean k3 KL(pi_behave || pi_prox): the train-inference mismatch."""
    mismatch_masked_ratio: float = 0.0
    """Share of trained tokens the mismatch mask took out."""


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / T) at `targets`, and the entropy of softmax(logits / T).

    logits (K, V) in any float dtype, targets (K,), temperature a float or (K,). Same
    convention as the inference engine: temperature applied, top-p/top-k not
    renormalised. Memory: one float32 copy of the logits (autograd keeps it for the
    backward of logsumexp); the entropy is computed without grad in row chunks, so it
    adds at most 1024 x V floats. Returns float32 (K,) tensors; entropy is detached.
    """
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(device=logits.device, dtype=torch.float32)[:, None]
    scaled = logits.float() / temperature
    lse = scaled.logsumexp(dim=-1)
    logp = scaled.gather(-1, targets[:, None]).squeeze(-1) - lse
    return logp, entropy_from_logits(scaled.detach(), lse.detach())


@torch.no_grad()
def entropy_from_logits(scaled: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v z_v per row of z (K, V), in row chunks."""
    if lse is None:
        lse = scaled.float().logsumexp(dim=-1)
    out = torch.empty(scaled.shape[0], dtype=torch.float32, device=scaled.device)
    for start in range(0, scaled.shape[0], _ENTROPY_CHUNK):
        z = scaled[start : start + _ENTROPY_CHUNK].float()
        row_lse = lse[start : start + _ENTROPY_CHUNK]
        p = (z - row_lse[:, None]).exp()
        out[start : start + _ENTROPY_CHUNK] = row_lse - (p * z).sum(dim=-1)
    return out


LOSS_KNOBS = frozenset(
    (
        "eps_clip",
        "eps_clip_higher",
        "behav_imp_weight_cap",
        "kl_coef",
        "mismatch_mask",
        "mismatch_low",
        "mismatch_high",
    )
)
"""The keyword settings of `ppo_loss` that `TrainerConfig` carries under the same names
(the trainer passes them as `cfg.model_dump(include=LOSS_KNOBS)`)."""


def ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behave_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_higher: float | None = None,
    behav_imp_weight_cap: float | None = None,
    mask: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
    mismatch_mask: MismatchMask = "none",
    mismatch_low: float = 0.5,
    mismatch_high: float = 5.0,
    seq_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The decoupled PPO loss of the module docstring, over tokens where `mask` is true
    (all tokens when None). All token tensors have one shape. `normalizer` replaces N
    (gradient accumulation passes the token count of the whole minibatch so that the
    summed micro-batch losses equal its token mean). prox/behave/ref get no gradient.
    `mismatch_mask="sequence"` needs `seq_ids` (the 0-based sequence of each token; 1-D
    token tensors)."""
    mask = torch.ones_like(logp, dtype=torch.bool) if mask is None else mask.bool()
    logp = logp.float()
    prox = prox_logp.detach().float()
    adv = advantages.detach().float()
    n = mask.sum()
    norm = n.clamp(min=1) if normalizer is None else normalizer

    log_w = prox - behave_logp.float()
    w = log_w.exp()
    if behav_imp_weight_cap is None:
        capped = torch.zeros_like(mask)
    else:
        capped = mask & (w > behav_imp_weight_cap)
    outside = _mismatch_outside(log_w, mask, mismatch_mask, mismatch_low, mismatch_high, seq_ids)
    masked = mask & outside & ~capped
    keep = mask & ~capped & ~masked
    # Zero w (not only the product) off `keep`: a huge capped w times a zero gradient
    # would otherwise give inf * 0 = nan in the backward.
    w = torch.where(keep, w, 0.0)

    ratio = (logp - prox).exp()
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    pg = torch.maximum(unclipped_loss, clipped_loss)
    loss = torch.where(keep, w * pg, 0.0).sum() / norm

    zero = torch.zeros((), device=logp.device)
    ref_kl = zero
    if ref_logp is not None:
        d = ref_logp.detach().float() - logp
        kl = torch.where(mask, d.exp() - d - 1.0, 0.0).sum()
        ref_kl = kl.detach()
        if kl_coef > 0:
            loss = loss + kl_coef * kl / norm

    with torch.no_grad():
        d_behave = logp - behave_logp.float()
        stats = LossStats(
            n_tokens=n.float(),
            importance_weight=w.sum(),
            clipped=(mask & (clipped_loss > unclipped_loss)).sum().float(),
            capped=capped.sum().float(),
            approx_kl=torch.where(mask, d_behave.exp() - 1.0 - d_behave, 0.0).sum(),
            ref_kl=ref_kl,
            entropy=zero if entropy is None else torch.where(mask, entropy.float(), 0.0).sum(),
            mismatch_kl=torch.where(mask, log_w.exp() - 1.0 - log_w, 0.0).sum(),
            mismatch_masked=masked.sum().float(),
        )
    return loss, stats


def _mismatch_outside(
    log_w: torch.Tensor,
    mask: torch.Tensor,
    kind: MismatchMask,
    low: float,
    high: float,
    seq_ids: torch.Tensor | None,
) -> torch.Tensor:
    """Tokens whose ratio (token) or sequence's geometric-mean ratio (sequence) leaves
    [low, high] (module docstring); all False for `none`."""
    if kind == "none":
        return torch.zeros_like(mask)
    lo, hi = math.log(low), math.log(high)
    if kind == "token":
        return (log_w < lo) | (log_w > hi)
    if kind != "sequence":
        raise ValueError(f"unknown mismatch_mask {kind!r}")
    if seq_ids is None:
        raise ValueError("mismatch_mask='sequence' needs seq_ids")
    n_seq = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    weights = mask.float()
    sums = torch.zeros(n_seq, device=log_w.device).index_add_(0, seq_ids, log_w * weights)
    counts = torch.zeros(n_seq, device=log_w.device).index_add_(0, seq_ids, weights)
    mean = sums / counts.clamp(min=1.0)
    bad = (mean < lo) | (mean > hi)
    return bad[seq_ids]
