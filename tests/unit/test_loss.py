"""Decoupled PPO loss and token logprobs against closed forms and analytic gradients."""

from __future__ import annotations

import math

import pytest
import torch

import trainer.loss as loss_mod
from trainer.loss import entropy_from_logits, ppo_loss, token_logprobs

# Five tokens. ratio = pi_theta/pi_prox, w = pi_prox/pi_behave, eps_clip = 0.2, cap = 5.
RATIO = [1.0, 1.5, 0.5, 1.1, 0.9]
ADV = [1.0, 1.0, -1.0, -2.0, 2.0]
W = [1.0, 2.0, 0.5, 10.0, 1.5]
#  tok0: unclipped, pg = -1            tok1: clipped at 1.2, pg = -1.2 (grad 0)
#  tok2: clipped at 0.8, pg = 0.8      tok3: w = 10 > cap: masked out (grad 0)
#  tok4: unclipped, pg = -1.8
PG = [-1.0, -1.2, 0.8, 2.2, -1.8]
KEEP = [1, 1, 1, 0, 1]


def _inputs():
    prox = torch.tensor([-1.0, -2.0, -0.5, -3.0, -0.7])
    logp = (prox + torch.log(torch.tensor(RATIO))).requires_grad_(True)
    behave = prox - torch.log(torch.tensor(W))
    return logp, prox, behave, torch.tensor(ADV)


def test_loss_value_and_stats():
    logp, prox, behave, adv = _inputs()
    loss, stats = ppo_loss(logp, prox, behave, adv, eps_clip=0.2, behav_imp_weight_cap=5.0)
    expected = sum(k * w * pg for k, w, pg in zip(KEEP, W, PG, strict=True)) / 5
    assert expected == pytest.approx(-1.14)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    s = stats.summary()
    assert s.n_tokens == 5
    assert s.importance_weight == pytest.approx((1 + 2 + 0.5 + 1.5) / 4, rel=1e-6)
    assert s.clip_ratio == pytest.approx(2 / 5)
    assert s.capped_ratio == pytest.approx(1 / 5)
    # k3 of theta vs behaviour: exp(d) - 1 - d with exp(d) = ratio * w
    k3 = [rw - 1 - math.log(rw) for rw in (r * w for r, w in zip(RATIO, W, strict=True))]
    assert s.approx_kl == pytest.approx(sum(k3) / 5, rel=1e-5)
    assert s.entropy == 0.0 and s.ref_kl == 0.0


def test_gradient_matches_analytic():
    logp, prox, behave, adv = _inputs()
    loss, _ = ppo_loss(logp, prox, behave, adv, eps_clip=0.2, behav_imp_weight_cap=5.0)
    loss.backward()
    # unclipped and kept: d/dlogp (-w A ratio / N) = -w A ratio / N; else 0
    expected = [-1.0 * 1.0 * 1.0 / 5, 0.0, 0.0, 0.0, -1.5 * 2.0 * 0.9 / 5]
    assert logp.grad.tolist() == pytest.approx(expected, abs=1e-6)


def test_clip_higher_mask_and_normalizer():
    logp, prox, behave, adv = _inputs()
    mask = torch.tensor([True, True, False, False, False])
    loss, stats = ppo_loss(
        logp, prox, behave, adv, eps_clip=0.2, eps_clip_higher=0.28, mask=mask, normalizer=10.0
    )
    # tok1 clipped at 1.28 instead of 1.2; only tok0 and tok1 count; divided by 10
    assert loss.item() == pytest.approx((1.0 * -1.0 + 2.0 * -1.28) / 10, rel=1e-6)
    assert stats.summary().n_tokens == 2
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-0.1, 0, 0, 0, 0], abs=1e-7)


def test_no_cap_keeps_large_weights():
    logp, prox, behave, adv = _inputs()
    loss, stats = ppo_loss(logp, prox, behave, adv, eps_clip=0.2)
    expected = sum(w * pg for w, pg in zip(W, PG, strict=True)) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats.summary().capped_ratio == 0.0


def test_capped_inf_weight_gives_finite_gradient():
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    behave = torch.tensor([-1.0, -500.0])  # w = exp(499) = inf in float32
    loss, _ = ppo_loss(
        logp, logp.detach(), behave, torch.ones(2), eps_clip=0.2, behav_imp_weight_cap=5.0
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad.tolist() == pytest.approx([-0.5, 0.0])


def test_kl_penalty_k3():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    adv = torch.zeros(2)
    loss, stats = ppo_loss(
        logp, logp.detach(), logp.detach(), adv, eps_clip=0.2, ref_logp=ref, kl_coef=0.1
    )
    d = [-0.5, 1.0]  # ref - theta
    k3 = [math.exp(x) - x - 1 for x in d]  # [0.106531, 0.718282]
    assert sum(k3) / 2 == pytest.approx(0.4124065, rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2, rel=1e-6)
    assert stats.summary().ref_kl == pytest.approx(sum(k3) / 2, rel=1e-6)
    loss.backward()
    # d/dtheta [exp(ref - theta) - (ref - theta) - 1] = 1 - exp(ref - theta)
    assert logp.grad.tolist() == pytest.approx([0.1 * (1 - math.exp(x)) / 2 for x in d], rel=1e-5)


def test_kl_term_adds_to_the_ppo_loss_over_masked_tokens():
    """PPO term and KL term together, by hand: the KL counts every masked token (a
    capped one too), shares the normalizer, and kl_coef = 0 leaves the loss and the
    gradient as without a reference while still reporting ref_kl."""
    logp, prox, behave, adv = _inputs()
    ref = prox + torch.tensor([0.0, 0.3, -0.2, 0.5, -1.0])
    mask = torch.tensor([True, True, True, True, False])
    kw = dict(eps_clip=0.2, behav_imp_weight_cap=5.0, mask=mask)
    loss, stats = ppo_loss(logp, prox, behave, adv, ref_logp=ref, kl_coef=0.5, **kw)
    d = [r - (p + math.log(x)) for r, p, x in zip(ref.tolist(), prox.tolist(), RATIO, strict=True)]
    k3 = [math.exp(x) - x - 1 for x in d]
    pg = sum(k * w * g for k, w, g in zip(KEEP[:4], W[:4], PG[:4], strict=True))
    assert loss.item() == pytest.approx((pg + 0.5 * sum(k3[:4])) / 4, rel=1e-6)
    assert stats.summary().ref_kl == pytest.approx(sum(k3[:4]) / 4, rel=1e-6)
    loss.backward()
    pg_grad = [-1.0 * 1.0 * 1.0, 0.0, 0.0, 0.0, 0.0]  # tok0 only: unclipped and kept
    expected = [(g + 0.5 * (1 - math.exp(x))) / 4 for g, x in zip(pg_grad, d, strict=True)]
    expected[4] = 0.0  # masked out
    assert logp.grad.tolist() == pytest.approx(expected, abs=1e-6)

    logp0, *_ = _inputs()
    off, off_stats = ppo_loss(logp0, prox, behave, adv, ref_logp=ref, kl_coef=0.0, **kw)
    assert off.item() == pytest.approx(pg / 4, rel=1e-6)
    assert off_stats.summary().ref_kl == pytest.approx(sum(k3[:4]) / 4, rel=1e-6)


def test_entropy_is_averaged_over_masked_tokens():
    logp, prox, behave, adv = _inputs()
    entropy = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    _, stats = ppo_loss(logp, prox, behave, adv, eps_clip=0.2, mask=mask, entropy=entropy)
    assert stats.summary().entropy == pytest.approx(2.5)
    merged = (stats + stats).summary()
    assert merged.n_tokens == 8 and merged.entropy == pytest.approx(2.5)


def test_token_logprobs_closed_form():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], requires_grad=True)
    targets = torch.tensor([2, 0])
    logp, entropy = token_logprobs(logits, targets, temperature=2.0)
    lse0 = math.log(math.exp(0.5) + math.exp(1.0) + math.exp(1.5))
    assert logp.tolist() == pytest.approx([1.5 - lse0, -math.log(3)], rel=1e-6)
    p0 = [math.exp(z - lse0) for z in (0.5, 1.0, 1.5)]
    assert entropy.tolist() == pytest.approx([-sum(p * math.log(p) for p in p0), math.log(3)])
    assert logp.dtype == torch.float32 and not entropy.requires_grad
    logp[0].backward()
    # d logp / d z = (onehot - softmax) / T
    assert logits.grad[0].tolist() == pytest.approx([(0 - p0[0]) / 2, -p0[1] / 2, (1 - p0[2]) / 2])


def test_token_logprobs_per_token_temperature_and_bf16():
    torch.manual_seed(0)
    logits = torch.randn(6, 11)
    targets = torch.randint(0, 11, (6,))
    temps = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.7, 1.3])
    logp, _ = token_logprobs(logits, targets, temps)
    ref = torch.log_softmax(logits.double() / temps.double()[:, None], -1)
    assert torch.allclose(logp.double(), ref.gather(1, targets[:, None]).squeeze(1), atol=1e-6)
    logp16, _ = token_logprobs(logits.bfloat16(), targets, temps)
    assert logp16.dtype == torch.float32


def test_entropy_chunks_agree(monkeypatch):
    torch.manual_seed(0)
    z = torch.randn(7, 13)
    whole = entropy_from_logits(z)
    monkeypatch.setattr(loss_mod, "_ENTROPY_CHUNK", 2)
    chunked = entropy_from_logits(z)
    p = torch.softmax(z.double(), -1)
    assert torch.allclose(whole.double(), -(p * p.log()).sum(-1), atol=1e-6)
    assert torch.allclose(whole, chunked)


# Mismatch masking, on the five tokens above (w = 1, 2, 0.5, 10, 1.5; cap 5 takes tok3).


def test_token_mismatch_mask_closed_form():
    """IcePop-style: tokens whose w leaves [a, b] = [0.6, 1.8] are out (tok1: 2, tok2: 0.5);
    tok3 stays counted as capped, not masked; N stays 5."""
    logp, prox, behave, adv = _inputs()
    loss, stats = ppo_loss(
        logp,
        prox,
        behave,
        adv,
        eps_clip=0.2,
        behav_imp_weight_cap=5.0,
        mismatch_mask="token",
        mismatch_low=0.6,
        mismatch_high=1.8,
    )
    keep = [1, 0, 0, 0, 1]
    expected = sum(k * w * pg for k, w, pg in zip(keep, W, PG, strict=True)) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    s = stats.summary()
    assert s.capped_ratio == pytest.approx(1 / 5)
    assert s.mismatch_masked_ratio == pytest.approx(2 / 5)
    assert s.importance_weight == pytest.approx((1 + 1.5) / 2, rel=1e-6)
    k3 = [w - 1 - math.log(w) for w in W]  # exp(l) - 1 - l, l = log w
    assert s.mismatch_kl == pytest.approx(sum(k3) / 5, rel=1e-5)
    loss.backward()
    expected_grad = [-1.0 / 5, 0.0, 0.0, 0.0, -1.5 * 2.0 * 0.9 / 5]
    assert logp.grad.tolist() == pytest.approx(expected_grad, abs=1e-6)


def test_sequence_mismatch_mask_closed_form():
    """MIS: sequence 0 = tok0..1 (geometric mean of w: sqrt(2) = 1.41), sequence 1 =
    tok2..4 ((0.5 * 10 * 1.5)^(1/3) = 1.96). With [a, b] = [0.5, 1.8] sequence 1 is
    masked whole (tok3 counts as capped), sequence 0 trains."""
    logp, prox, behave, adv = _inputs()
    seq_ids = torch.tensor([0, 0, 1, 1, 1])
    loss, stats = ppo_loss(
        logp,
        prox,
        behave,
        adv,
        eps_clip=0.2,
        behav_imp_weight_cap=5.0,
        mismatch_mask="sequence",
        mismatch_low=0.5,
        mismatch_high=1.8,
        seq_ids=seq_ids,
    )
    keep = [1, 1, 0, 0, 0]
    expected = sum(k * w * pg for k, w, pg in zip(keep, W, PG, strict=True)) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats.summary().mismatch_masked_ratio == pytest.approx(2 / 5)
    # Within [0.5, 2.0] both sequences train (as with no mask).
    wide, _ = ppo_loss(
        logp,
        prox,
        behave,
        adv,
        eps_clip=0.2,
        behav_imp_weight_cap=5.0,
        mismatch_mask="sequence",
        mismatch_low=0.5,
        mismatch_high=2.0,
        seq_ids=seq_ids,
    )
    plain, _ = ppo_loss(logp, prox, behave, adv, eps_clip=0.2, behav_imp_weight_cap=5.0)
    assert wide.item() == pytest.approx(plain.item(), rel=1e-6)
    with pytest.raises(ValueError, match="seq_ids"):
        ppo_loss(logp, prox, behave, adv, eps_clip=0.2, mismatch_mask="sequence")
