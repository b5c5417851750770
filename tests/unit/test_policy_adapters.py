"""Several policies' adapters on the local engine (issue 29, second slice): the runner
holds one LoRA adapter per name, runs each batch row under its own adapter (PEFT's
mixed batch), a row of a policy whose adapter has not arrived runs on the base (its
untrained version 0), swapping one adapter leaves the others' outputs untouched, and the
scheduler labels each row's tokens with its own adapter's version."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from areal_service.config import LoRAConfig
from areal_service.sglang_protocol import SamplingParams
from engine.runner import ModelRunner, WeightLoadError
from engine.scheduler import Request, Scheduler
from trainer.lora import save_adapter, wrap_lora
from trainer.model import destroy_distributed, init_distributed, load_policy

PROMPTS = [[5, 17, 42, 9, 3, 28, 11], [7, 7, 19, 2], [30, 1, 4, 4, 8, 2]]


@pytest.fixture
def group():
    destroy_distributed()
    yield init_distributed("cpu")
    destroy_distributed()


def _adapter(model_dir: Path, out: Path, seed: int, lora: LoRAConfig) -> torch.nn.Module:
    """A published adapter with random (nonzero) A and B, and the trainer's PEFT model."""
    torch.manual_seed(seed)
    model = wrap_lora(load_policy(model_dir), lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.05)
    save_adapter(model, out)
    return model.eval()


def _last_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0, -1].float()


def test_each_row_runs_under_its_own_adapter(group, tiny_model_dir, tmp_path) -> None:
    runner = ModelRunner(tiny_model_dir, device="cpu", dtype="float32")
    base = [_last_logits(runner.model, p) for p in PROMPTS]
    default = _adapter(tiny_model_dir, tmp_path / "d1", 1, LoRAConfig(rank=8))
    solver = _adapter(tiny_model_dir, tmp_path / "s1", 2, LoRAConfig(rank=4, alpha=8))
    runner.load_weights(tmp_path / "d1")
    runner.load_weights(tmp_path / "s1", adapter="solver")
    expected = {
        None: [_last_logits(default, p) for p in PROMPTS],
        "solver": [_last_logits(solver, p) for p in PROMPTS],
        "verifier": base,
    }  # not loaded yet: its version 0 is the base model
    rows: list[str | None] = [None, "solver", "verifier"]
    pre = runner.prefill(PROMPTS, rows)
    for row, name in enumerate(rows):
        got, want = pre.logits[row], expected[name][row]
        assert float((got - want).abs().max()) <= 1e-4, name
    assert float((expected["solver"][1] - expected[None][1]).abs().max()) > 1e-2
    # Decode keeps each row on its adapter: compare one step with a full forward.
    runner.join(pre, [0, 1, 2])
    nxt = [int(t) for t in pre.logits.argmax(-1)]
    step = runner.decode(nxt, rows)
    for row, name in enumerate(rows):
        model = {None: default, "solver": solver, "verifier": None}[name]
        want = _last_logits(
            model if model is not None else load_policy(tiny_model_dir).eval(),
            PROMPTS[row] + [nxt[row]],
        )
        assert float((step[row] - want).abs().max()) <= 1e-4, name
    runner.reset_batch()

    # Swapping the solver's adapter leaves the default rows exactly as they were.
    solver2 = _adapter(tiny_model_dir, tmp_path / "s2", 3, LoRAConfig(rank=4, alpha=8))
    runner.load_weights(tmp_path / "s2", adapter="solver")
    again = runner.prefill(PROMPTS, rows)
    assert torch.equal(again.logits[0], pre.logits[0])  # the same rows, bit for bit
    assert torch.equal(again.logits[2], pre.logits[2])
    assert float((again.logits[1] - _last_logits(solver2, PROMPTS[1])).abs().max()) <= 1e-4
    runner.reset_batch()
    # A third adapter on more modules than the solver's (new LoRA layers, hooked too):
    # every row still runs under its own adapter only.
    narrow = _adapter(
        tiny_model_dir, tmp_path / "n1", 5, LoRAConfig(rank=4, target_modules=["q_proj"])
    )
    wide = _adapter(tiny_model_dir, tmp_path / "w1", 6, LoRAConfig(rank=4))
    fresh = ModelRunner(tiny_model_dir, device="cpu", dtype="float32")
    fresh.load_weights(tmp_path / "n1", adapter="narrow")
    fresh.load_weights(tmp_path / "w1", adapter="wide")
    mixed = fresh.prefill(PROMPTS, ["narrow", "wide", None])
    for row, model in enumerate((narrow, wide, load_policy(tiny_model_dir).eval())):
        got, want = mixed.logits[row], _last_logits(model, PROMPTS[row])
        assert float((got - want).abs().max()) <= 1e-4, row
    # A named adapter of another shape than the one served under that name is refused.
    _adapter(tiny_model_dir, tmp_path / "s8", 4, LoRAConfig(rank=8))
    with pytest.raises(WeightLoadError, match="another shape"):
        runner.load_weights(tmp_path / "s8", adapter="solver")


def test_tokens_carry_their_own_adapters_version(group, tiny_model_dir, tmp_path) -> None:
    _adapter(tiny_model_dir, tmp_path / "s1", 2, LoRAConfig(rank=4))
    scheduler = Scheduler(
        str(tiny_model_dir), device="cpu", dtype="float32", max_running=4, weight_version="7"
    )
    scheduler.start()
    try:
        loaded = scheduler.update_weights(
            str(tmp_path / "s1"),
            weight_version="3",
            flush_cache=True,
            abort_all=False,
            lora_name="solver",
        ).result(timeout=120)
        assert loaded.success, loaded.message
        reqs = [
            Request(
                rid=f"r{i}",
                prompt_ids=PROMPTS[i],
                max_new_tokens=3,
                params=SamplingParams(temperature=0, max_new_tokens=3),
                stop_token_ids=frozenset(),
                notify=lambda: None,
                stream=False,
                lora=lora,
            )
            for i, lora in enumerate((None, "solver", "verifier"))
        ]
        futures = [scheduler.submit(r) for r in reqs]
        for f in futures:
            f.result(timeout=120)
        deadline = time.monotonic() + 120
        while any(r.finish is None for r in reqs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r.snapshot().weight_version for r in reqs] == ["7", "3", "0"]
        assert scheduler.weight_version == "7"  # the default policy's version is untouched
    finally:
        scheduler.stop()


def _long(rid: str, prompt: list[int], lora: str | None, new: int = 400) -> Request:
    return Request(
        rid=rid,
        prompt_ids=prompt,
        max_new_tokens=new,
        params=SamplingParams(temperature=0, max_new_tokens=new),
        stop_token_ids=frozenset(),
        notify=lambda: None,
        stream=True,
        lora=lora,
    )


@pytest.mark.parametrize("swapped", ["solver", "default"])
def test_one_adapters_swap_touches_only_its_own_rows(
    group, tiny_model_dir, tmp_path, swapped: str
) -> None:
    """A policy's adapter swap neither pauses nor waits: it lands while every row is
    running, ends only that policy's started row (a plain abort, which the gateway
    resubmits), and the other policies' rows go on to their full length with their KV
    kept (never retracted) and their versions unchanged. The default policy's adapter
    (`lora_name` "default", its rows naming no adapter) swaps the same way."""
    _adapter(tiny_model_dir, tmp_path / "s1", 2, LoRAConfig(rank=4))
    _adapter(tiny_model_dir, tmp_path / "s2", 3, LoRAConfig(rank=4))
    scheduler = Scheduler(
        str(tiny_model_dir), device="cpu", dtype="float32", max_running=4, weight_version="7"
    )
    scheduler.start()
    try:

        def load(path: str, version: str, name: str = "solver") -> None:
            result = scheduler.update_weights(
                path, weight_version=version, flush_cache=True, abort_all=False, lora_name=name
            ).result(timeout=120)
            assert result.success, result.message

        load(str(tmp_path / "s1"), "1")
        load(str(tmp_path / "s1"), "7", "default")  # the default policy's adapter
        reqs = [
            _long(f"r{i}", PROMPTS[i], lora) for i, lora in enumerate((None, "solver", "verifier"))
        ]
        for r in reqs:
            scheduler.submit(r).result(timeout=120)
        deadline = time.monotonic() + 120
        while min(len(r.snapshot().output_ids) for r in reqs) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        load(str(tmp_path / "s2"), "8" if swapped == "default" else "2", swapped)
        swapped_at = [len(r.snapshot().output_ids) for r in reqs]
        assert all(n < 400 for n in swapped_at)  # every row was still running
        while any(r.finish is None for r in reqs):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cut = reqs[0] if swapped == "default" else reqs[1]
        assert cut.finish is not None and cut.finish.type == "abort"
        assert cut.finish.status_code is None  # a pause-style abort: resubmitted
        assert cut.snapshot().weight_version == ("7" if swapped == "default" else "1")
        for r in reqs:
            if r is not cut:
                assert r.finish is not None and r.finish.type == "length", r.finish
                assert len(r.output_ids) == 400 and r.num_retractions == 0
        assert reqs[2].weight_version == "0"
        if swapped == "default":
            assert scheduler.weight_version == "8" and reqs[1].weight_version == "1"
            assert scheduler.adapter_versions == {"solver": "1"}
        else:
            assert scheduler.weight_version == "7" == reqs[0].weight_version
            assert scheduler.adapter_versions == {"solver": "2"}
        assert scheduler.paused is None
        later = _long("r9", PROMPTS[1], None if swapped == "default" else "solver", new=3)
        scheduler.submit(later).result(timeout=120)
        while later.finish is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert later.weight_version == ("8" if swapped == "default" else "2")
        assert later.finish.type == "length"
    finally:
        scheduler.stop()
