"""ModelRunner against a plain transformers forward: batched, left-padded prefill and
decode with rows joining and leaving; sampling conventions; weight reloads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.runner import ModelRunner, SamplingSpec, WeightLoadError
from engine.testing import make_weight_variant


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(tiny_model_dir, device="cpu")


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _last_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0, -1].float()


def _seqs(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 600, (n,), generator=gen).tolist() for n in lengths]


def test_batched_prefill_and_decode_match_unbatched_forward(runner: ModelRunner, reference) -> None:
    runner.reset_batch()
    seqs = _seqs([5, 17, 2])
    pre = runner.prefill(seqs)
    for i, seq in enumerate(seqs):
        assert torch.allclose(pre.logits[i], _last_logits(reference, seq), atol=1e-4)
    runner.join(pre, [0, 1, 2])
    tokens = pre.logits.argmax(-1).tolist()
    for step in range(6):
        for seq, tok in zip(seqs, tokens, strict=True):
            seq.append(tok)
        logits = runner.decode(tokens)
        for i, seq in enumerate(seqs):
            assert torch.allclose(logits[i], _last_logits(reference, seq), atol=1e-4), (step, i)
        tokens = logits.argmax(-1).tolist()
        if step == 2:  # row 1 (the longest) leaves, a new long row joins mid-flight
            runner.keep([0, 2])
            seqs, tokens = [seqs[0], seqs[2]], [tokens[0], tokens[2]]
            late = _seqs([30], seed=1)[0]
            pre2 = runner.prefill([late])
            runner.join(pre2, [0])
            seqs.append(late)
            tokens.append(int(pre2.logits[0].argmax()))
    assert runner.batch_size == 3
    runner.reset_batch()
    assert runner.batch_size == 0


def test_repeated_prompts_are_prefilled_once(runner: ModelRunner, reference) -> None:
    """A GRPO group's samples share one prompt: the forward sees each distinct row once,
    and every copy decodes like its own prefill."""
    runner.reset_batch()
    a, b = _seqs([7, 12], seed=3)
    seqs = [a, b, list(a), list(a), list(b)]
    widths = []
    hook = runner.model.register_forward_pre_hook(
        lambda _m, _args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    try:
        pre = runner.prefill(seqs)
    finally:
        hook.remove()
    assert widths == [(2, 12)]  # a and b once, left-padded to b's length
    for i, seq in enumerate(seqs):
        assert torch.allclose(pre.logits[i], _last_logits(reference, seq), atol=1e-4)
    runner.join(pre, [0, 1, 2, 3, 4])
    tokens = [3, 4, 5, 6, 7]  # the copies diverge at once, as sampled copies do
    logits = runner.decode(tokens)
    for i, (seq, tok) in enumerate(zip(seqs, tokens, strict=True)):
        assert torch.allclose(logits[i], _last_logits(reference, [*seq, tok]), atol=1e-4), i
    runner.reset_batch()


def test_join_only_selected_rows_trims_padding(runner: ModelRunner) -> None:
    runner.reset_batch()
    pre = runner.prefill(_seqs([40, 4, 6]))
    runner.join(pre, [1, 2])
    # Only the short rows joined: the 40-wide padding they carried is dropped.
    assert runner.batch_size == 2 and runner.kv_columns == 6
    runner.reset_batch()


def test_sampling_logprob_conventions(runner: ModelRunner) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    specs = [
        SamplingSpec(temperature=0.0),
        SamplingSpec(temperature=0.7),
        SamplingSpec(temperature=1.0, top_k=1),
        SamplingSpec(temperature=1.3, top_p=0.05),
    ]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    res = runner.sample(logits, specs, gens, top_n=[0, 3, 0, 0])
    argmax = logits.argmax(-1).tolist()
    assert res.tokens[0] == argmax[0]
    # Truncation (top_k=1, tiny top_p) forces the argmax but is not renormalised into the logprob.
    assert res.tokens[2] == argmax[2] and res.tokens[3] == argmax[3]
    for row, temp in enumerate([1.0, 0.7, 1.0, 1.3]):
        expected = torch.log_softmax(logits[row] / temp, -1)[res.tokens[row]].item()
        assert res.logprobs[row] == pytest.approx(expected, abs=1e-5)
    assert res.logprobs[2] < -1e-3
    top = res.top_logprobs[1]
    assert len(top) == 3 and top[0][1] == argmax[1] and res.top_logprobs[0] == []


def test_seeded_sampling_is_reproducible(runner: ModelRunner) -> None:
    logits = torch.zeros(1, 600)
    draw = [
        [runner.sample(logits, [SamplingSpec()], [g], [0]).tokens[0] for _ in range(8)]
        for g in (
            torch.Generator().manual_seed(7),
            torch.Generator().manual_seed(7),
            torch.Generator().manual_seed(8),
        )
    ]
    assert draw[0] == draw[1]
    assert draw[0] != draw[2]


def test_load_weights_swaps_and_rejects_mismatches(tiny_model_dir: Path, tmp_path: Path) -> None:
    runner = ModelRunner(tiny_model_dir, device="cpu")
    seq = _seqs([8])[0]
    before = runner.prefill([seq]).logits[0]
    variant = make_weight_variant(tiny_model_dir, tmp_path / "v1", seed=1)

    # Same keys, other shapes: rejected before any tensor is copied.
    wide = tmp_path / "wide"
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.update({"hidden_size": 64, "intermediate_size": 96})
    AutoModelForCausalLM.from_config(config).save_pretrained(wide)
    with pytest.raises(WeightLoadError, match="shape"):
        runner.load_weights(wide)
    with pytest.raises(WeightLoadError, match="no \\*.safetensors"):
        runner.load_weights(tmp_path / "missing")
    assert torch.equal(runner.prefill([seq]).logits[0], before)

    runner.load_weights(variant)
    after = runner.prefill([seq]).logits[0]
    expected = _last_logits(AutoModelForCausalLM.from_pretrained(variant), seq)
    assert not torch.allclose(after, before, atol=1e-3)
    assert torch.allclose(after, expected, atol=1e-4)


def test_forward_passes_the_cache_without_deprecation_warnings(runner: ModelRunner) -> None:
    """transformers 5.x renamed forward's `past_key_values` to `cache` (the old name warns
    on every call); the runner passes whichever name the model's forward declares."""
    import warnings

    assert runner._cache_kw == "cache"  # the installed transformers' Llama/Qwen2 forward
    runner.reset_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = runner.prefill(_seqs([4, 9]))
        runner.join(pre, [0, 1])
        runner.decode(pre.logits.argmax(-1).tolist())
    runner.reset_batch()


def test_cache_keyword_follows_the_forward_signature() -> None:
    from engine.runner import cache_keyword

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return input_ids

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs):
            return input_ids

    class Neither(torch.nn.Module):
        def forward(self, input_ids, **kwargs):
            return input_ids

    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(New()) == "cache"
    with pytest.raises(ValueError, match="no `cache` or `past_key_values`"):
        cache_keyword(Neither())
