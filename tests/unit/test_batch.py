"""Packing: a packed row gives the same logprobs as each sequence alone (real tiny Qwen2,
the trainer's packed sdpa, sdpa and eager), and the same gradients; the packed sdpa
attends per sequence (not over the row); no trained token is lost or duplicated, the
budget holds."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_service.types import TrainSequence
from trainer.batch import build_micro_batches, pack_bins
from trainer.packed_attention import PACKED_SDPA, register_packed_sdpa
from trainer.step import forward_logprobs


def _seq(rng: random.Random, n_prompt: int, n_out: int, *, t: float = 1.0, tag: int = 0):
    ids = tuple(rng.randrange(600) for _ in range(n_prompt + n_out))
    # a tool-result style hole inside the output: two untrained tokens
    mask = tuple([0] * n_prompt + [1] * n_out)
    if n_out > 4:
        mask = mask[: n_prompt + 2] + (0, 0) + mask[n_prompt + 4 :]
    logprobs = tuple(-0.01 * (tag * 1000 + k) if m else 0.0 for k, m in enumerate(mask))
    return TrainSequence(
        session_id=f"s{tag}",
        group_id="g",
        completion_ids=(f"c{tag}",),
        input_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        versions=tuple(0 if m else -1 for m in mask),
        reward=float(tag),
        temperature=t,
    )


@pytest.fixture(scope="module")
def sequences():
    rng = random.Random(0)
    specs = [(5, 7, 1.0), (3, 2, 0.7), (9, 12, 1.3), (4, 1, 0.0), (2, 6, 1.0)]
    return [_seq(rng, p, o, t=t, tag=i) for i, (p, o, t) in enumerate(specs)]


def _trained(seq: TrainSequence) -> list[tuple[int, int]]:
    return [(k, seq.input_ids[k]) for k in range(1, len(seq.input_ids)) if seq.loss_mask[k]]


def test_no_token_lost_and_budget_respected(sequences):
    advs = [0.5, -1.0, 2.0, 0.0, 1.5]
    mbs = build_micro_batches(sequences, advs, max_tokens_per_mb=24)
    assert all(mb.n_input_tokens <= 24 for mb in mbs)
    assert sorted(n for mb in mbs for n in mb.seq_lens) == sorted(
        len(s.input_ids) for s in sequences
    )
    got = sorted(
        (round(b, 3), int(t), round(a, 3), round(temp, 3))
        for mb in mbs
        for b, t, a, temp in zip(
            mb.behave_logprobs.tolist(),
            mb.targets,
            mb.advantages.tolist(),
            mb.temperature.tolist(),
            strict=True,
        )
    )
    want = sorted(
        (round(s.logprobs[k], 3), tok, a, round(s.temperature or 1.0, 3))  # greedy -> T = 1
        for s, a in zip(sequences, advs, strict=True)
        for k, tok in _trained(s)
    )
    assert got == want
    for mb in mbs:
        # the logit feeding target t sits at t - 1 and never at a sequence's last token
        assert torch.equal(mb.input_ids[0, mb.logit_index + 1], mb.targets)
        starts = torch.tensor([0, *torch.tensor(mb.seq_lens).cumsum(0).tolist()])
        assert not torch.isin(mb.logit_index, starts[1:] - 1).any()
        pos = torch.cat([torch.arange(n) for n in mb.seq_lens])
        assert torch.equal(mb.position_ids[0], pos)
        assert mb.n_tokens == mb.advantages.numel() == mb.behave_logprobs.numel()


def test_long_sequence_gets_its_own_micro_batch(sequences):
    mbs = build_micro_batches(sequences, [1.0] * 5, max_tokens_per_mb=8)
    assert [mb.seq_lens for mb in mbs if mb.n_input_tokens > 8] == [(21,), (12,)]
    assert sum(len(mb.seq_lens) for mb in mbs) == 5


def test_sequence_without_trained_tokens_is_left_out():
    rng = random.Random(1)
    prompt_only = _seq(rng, 6, 0)
    first_token_only = TrainSequence("s", None, ("c",), (1, 2), (1, 0), (-1.0, 0.0), (0, -1), 0.0)
    assert build_micro_batches([prompt_only, first_token_only], [1.0, 1.0], 100) == []


def test_length_mismatch_is_rejected():
    bad = TrainSequence("s", None, ("c",), (1, 2, 3), (0, 1), (0.0, -1.0), (-1, 0), 0.0)
    with pytest.raises(ValueError, match="lengths differ"):
        build_micro_batches([bad], [1.0], 100)


def test_first_fit_decreasing():
    assert pack_bins([5, 3, 8, 2, 4], 10) == [[2, 3], [0, 4], [1]]
    assert pack_bins([12, 1], 10) == [[0], [1]]
    assert pack_bins([], 10) == []


@pytest.mark.parametrize("impl", [PACKED_SDPA, "sdpa", "eager"])
def test_packed_logprobs_equal_unpacked(tiny_model_dir, sequences, impl):
    register_packed_sdpa()
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation=impl
    ).eval()
    advs = [0.0] * len(sequences)
    (mb,) = build_micro_batches(sequences, advs, max_tokens_per_mb=1000)
    assert len(mb.seq_lens) == 5
    with torch.no_grad():
        packed, _ = forward_logprobs(model, mb)
        alone = []
        for s in sorted(sequences, key=lambda s: -len(s.input_ids)):  # row order (FFD)
            logits = model(torch.tensor([s.input_ids]), use_cache=False).logits[0]
            t = s.temperature or 1.0
            lp = torch.log_softmax(logits / t, -1)
            alone += [lp[k - 1, tok].item() for k, tok in _trained(s)]
        assert packed.tolist() == pytest.approx(alone, abs=1e-5)
        # The hazard batch.py documents: with a KV cache the packed mask is not built
        # and later sequences attend to earlier ones.
        leaky = model(mb.input_ids, position_ids=mb.position_ids, use_cache=True).logits[0]
        leaky_lp = torch.log_softmax(leaky[mb.logit_index] / mb.temperature[:, None], -1)
        leaky_lp = leaky_lp.gather(1, mb.targets[:, None]).squeeze(1)
        assert (leaky_lp - packed).abs().max() > 1e-3


def test_packed_sdpa_attends_per_sequence_with_the_same_gradients(
    tiny_model_dir, sequences, monkeypatch
):
    """The trainer's default attention runs one causal SDPA over the sequences padded to
    the longest (5 x 21 here), not over the 57-token row, and its loss gradient equals
    sdpa's with the row's block-diagonal mask (tiny Qwen2: grouped-query heads)."""
    register_packed_sdpa()
    (mb,) = build_micro_batches(sequences, [1.0, -0.5, 2.0, 0.3, -1.0], max_tokens_per_mb=1000)
    shapes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        shapes.append(tuple(q.shape))
        return sdpa(q, *args, **kwargs)

    grads = {}
    for impl in (PACKED_SDPA, "sdpa"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(
            tiny_model_dir, dtype=torch.float32, attn_implementation=impl
        ).train()
        with monkeypatch.context() as m:
            m.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
            logp, _ = forward_logprobs(model, mb)
        (logp * mb.advantages).sum().backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters()}
        if impl == PACKED_SDPA:
            longest, row = max(mb.seq_lens), mb.n_input_tokens
            assert shapes and all(s[0] == 5 and s[2] == longest < row for s in shapes), shapes
            shapes.clear()
    assert shapes and all(s[0] == 1 and s[2] == mb.n_input_tokens for s in shapes)
    for name, g in grads["sdpa"].items():
        assert torch.allclose(grads[PACKED_SDPA][name], g, atol=1e-5, rtol=1e-4), name


def test_token_sequence_ids_follow_the_packing(sequences):
    """The sequence-level mismatch mask (MIS) groups a row's tokens by these ids."""
    from trainer.step import token_sequence_ids

    advs = [0.5, -1.0, 2.0, 0.25, 1.5]
    trained = {a: sum(s.loss_mask[1:]) for s, a in zip(sequences, advs, strict=True)}
    for mb in build_micro_batches(sequences, advs, max_tokens_per_mb=24):
        ids = token_sequence_ids(mb).tolist()
        assert ids == sorted(ids) and len(ids) == mb.n_tokens
        for j in range(len(mb.seq_lens)):
            mine = [a for i, a in zip(ids, mb.advantages.tolist(), strict=True) if i == j]
            assert len(set(mine)) == 1 and len(mine) == trained[mine[0]]
