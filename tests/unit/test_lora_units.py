"""LoRA (`default_policy.lora`, formerly `trainer.lora`): the config section and its refusals; PEFT under FSDP2 on CPU
trains the adapter alone (the base stays bit-identical), publishes PEFT's adapter files
only and reloads them; the local engine's runner serves a published adapter with logits
equal to the trainer's PEFT forward, swaps it in place and refuses one that does not fit
(the served one stays)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from areal_service.config import (
    LORA_TARGETS,
    LoRAConfig,
    TrainerConfig,
    load_config,
)
from areal_service.config_errors import ConfigError
from areal_service.lora_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_dir
from areal_service.types import TrainSequence
from engine.runner import ModelRunner, WeightLoadError
from trainer.batch import build_micro_batches
from trainer.lora import adapter_state, is_lora, load_adapter_weights, save_adapter, wrap_lora
from trainer.model import apply_fsdp2, destroy_distributed, init_distributed, load_policy
from trainer.step import build_optimizer, compute_logprobs, train_step

CFG = TrainerConfig(lr=1e-2, weight_decay=0.0, max_tokens_per_mb=10_000)
LORA = LoRAConfig()


def _sequences(n: int = 4) -> list[TrainSequence]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        n_prompt, n_out = rng.randint(3, 8), rng.randint(4, 10)
        mask = (0,) * n_prompt + (1,) * n_out
        out.append(
            TrainSequence(
                session_id=f"s{i}",
                group_id="g",
                completion_ids=(f"c{i}",),
                input_ids=tuple(rng.randrange(600) for _ in mask),
                loss_mask=mask,
                logprobs=tuple(-6.0 if m else 0.0 for m in mask),
                versions=tuple(0 if m else -1 for m in mask),
                reward=float(i % 2),
            )
        )
    return out


@pytest.fixture
def group():
    destroy_distributed()
    yield init_distributed("cpu")
    destroy_distributed()


def test_lora_config_defaults_off_and_refuses_what_cannot_serve_it():
    assert load_config(None, []).default_policy.lora is None  # full fine-tuning by default
    cfg = load_config(None, ["default_policy.lora.rank=16"]).default_policy.lora
    assert cfg is not None and cfg.rank == 16 and cfg.alpha == 16 and cfg.dropout == 0
    assert tuple(cfg.target_modules) == LORA_TARGETS
    with pytest.raises(ConfigError, match="weight_sync=disk"):
        load_config(None, ["default_policy.lora.rank=8", "trainer.weight_sync=distributed"])
    with pytest.raises(ConfigError, match="router"):
        load_config(
            None,
            [
                "default_policy.lora.rank=8",
                "engine.backend=sglang",
                "gateway.router.url=http://h:1",
            ],
        )
    with pytest.raises(ConfigError, match="rank"):
        load_config(None, ["default_policy.lora.rank=0"])
    with pytest.raises(ConfigError, match="alpha"):  # a NaN from the first step
        load_config(None, ["default_policy.lora.alpha=.inf"])


def test_lora_trains_only_the_adapter_and_publishes_it_alone(group, tiny_model_dir, tmp_path):
    model = apply_fsdp2(wrap_lora(load_policy(tiny_model_dir), LORA))
    assert is_lora(model) and not is_lora(load_policy(tiny_model_dir))
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer(model, CFG)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(names)
    stats = train_step(
        model, optimizer, build_micro_batches(_sequences(), [1, -1, 0.5, -0.5], 10_000), CFG
    )
    assert stats.grad_norm > 0
    after = {n: p.full_tensor() for n, p in model.named_parameters()}
    frozen_moved = [n for n in after if n not in names and not after[n].equal(before[n])]
    moved = {n for n in names if not after[n].equal(before[n])}
    # B starts at 0, so A's first gradient is 0 too: the first step moves every B
    assert frozen_moved == [] and moved == {n for n in names if ".lora_B." in n}

    out = save_adapter(model, tmp_path / "weights" / "v1")
    assert is_adapter_dir(out) and not is_adapter_dir(tiny_model_dir)
    assert sorted(p.name for p in out.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    assert set(config["target_modules"]) == set(LORA_TARGETS)
    saved = load_file(out / ADAPTER_WEIGHTS)
    assert saved.keys() == adapter_state(model).keys()
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in saved)
    base_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    assert (out / ADAPTER_WEIGHTS).stat().st_size < base_bytes / 3

    # Resume from the published adapter: a fresh wrapped model computes the same logprobs.
    mb = build_micro_batches(_sequences(), [0.0] * 4, 10_000)[0]
    fresh = apply_fsdp2(wrap_lora(load_policy(tiny_model_dir), LORA))
    [trained], [untrained] = compute_logprobs(model, [mb]), compute_logprobs(fresh, [mb])
    load_adapter_weights(fresh, out)
    [reloaded] = compute_logprobs(fresh, [mb])
    assert float((trained - untrained).abs().max()) > 1e-3
    assert torch.equal(trained, reloaded)


def _published_adapter(tiny_model_dir, out, seed: int, lora: LoRAConfig = LORA):
    """An adapter with random (nonzero) A and B, as the trainer writes it."""
    torch.manual_seed(seed)
    model = wrap_lora(load_policy(tiny_model_dir), lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.05)
    save_adapter(model, out)
    return model.eval()


def test_engine_serves_the_adapter_like_the_trainer_and_swaps_in_place(
    group, tiny_model_dir, tmp_path
):
    runner = ModelRunner(tiny_model_dir, device="cpu", dtype="float32")
    ids = torch.tensor([[5, 17, 42, 9, 3, 28, 11]])
    with torch.no_grad():
        base = runner.model(input_ids=ids).logits
    sides = {v: _published_adapter(tiny_model_dir, tmp_path / f"v{v}", v) for v in (1, 2)}
    # A damaged first adapter is refused; the base keeps serving unchanged, and the
    # layers injected for it are reused by the next (no second injection).
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / ADAPTER_CONFIG).write_text((tmp_path / "v1" / ADAPTER_CONFIG).read_text())
    save_file({"x.lora_A.weight": torch.zeros(2, 2)}, str(tmp_path / "bad" / ADAPTER_WEIGHTS))
    with pytest.raises(WeightLoadError, match="does not fit"):
        runner.load_weights(tmp_path / "bad")
    with torch.no_grad():
        assert torch.equal(runner.model(input_ids=ids).logits, base)
    layers = [m for n, m in runner.model.named_modules() if n.endswith("lora_A.default")]
    assert layers
    for version, trainer_side in sides.items():
        runner.load_weights(tmp_path / f"v{version}")
        with torch.no_grad():
            served = runner.model(input_ids=ids).logits
            expected = trainer_side(input_ids=ids).logits
        assert float((served - expected).abs().max()) <= 1e-5
        assert float((served - base).abs().max()) > 1e-2
        # every version is copied into the modules injected once
        assert [
            m for n, m in runner.model.named_modules() if n.endswith("lora_A.default")
        ] == layers
    assert runner.model_dir == tmp_path / "v2"

    # An adapter of another rank, or a damaged file, is refused; v2 keeps serving.
    _published_adapter(tiny_model_dir, tmp_path / "r4", 3, LoRAConfig(rank=4))
    for bad, message in (("r4", "another shape"), ("bad", "does not fit")):
        with pytest.raises(WeightLoadError, match=message):
            runner.load_weights(tmp_path / bad)
        with torch.no_grad():
            assert torch.equal(runner.model(input_ids=ids).logits, served)


def test_vllm_launch_flags_and_a_full_weights_backend_refuses_an_adapter(tmp_path):
    import asyncio

    from gateway.backends import BackendError
    from gateway.backends.vllm import VLLMClient
    from launcher.vllm_servers import max_lora_rank, vllm_argv, vllm_env

    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    config = load_config(
        None, [f"data_dir={tmp_path}", "engine.backend=vllm", "default_policy.lora.rank=12"]
    )
    argv = vllm_argv(config, 9000, on_gpu=False)
    flags = " ".join(argv)
    assert "--enable-lora --max-loras 1 --max-lora-rank 16" in flags
    assert f"--lora-modules areal-lora={tmp_path / 'lora-v0'}" in flags
    assert vllm_env(config, None)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    plain = load_config(None, [f"data_dir={tmp_path}", "engine.backend=vllm"])
    assert "--enable-lora" not in vllm_argv(plain, 9000, on_gpu=False)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm_env(plain, None)

    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / ADAPTER_CONFIG).write_text("{}")
    client = VLLMClient("http://127.0.0.1:9")  # never reached: refused before any call
    with pytest.raises(BackendError, match="serves full weights") as err:
        asyncio.run(client.update_weights_from_disk(str(tmp_path / "v1"), "1"))
    assert err.value.status == 400


def _lora_rank_main(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    import os

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    torch.manual_seed(1 + rank)  # as the trainer seeds each rank (seed + rank)
    init_distributed("cpu")
    model = apply_fsdp2(wrap_lora(load_policy(model_dir), LORA))
    seqs, advs = _sequences()[rank::2], [1, -1, 0.5, -0.5][rank::2]
    stats = train_step(
        model, build_optimizer(model, CFG), build_micro_batches(seqs, advs, 10_000), CFG
    )
    out = save_adapter(model, Path(out_dir) / "v1")
    fresh = apply_fsdp2(wrap_lora(load_policy(model_dir), LORA))
    load_adapter_weights(fresh, out)  # resume at world size 2
    same = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for (_, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True)
    )
    torch.save({"grad_norm": stats.grad_norm, "same": same}, Path(out_dir) / f"rank{rank}.pt")
    destroy_distributed()


@pytest.mark.processes
def test_lora_two_ranks_train_publish_and_resume_like_one(group, tiny_model_dir, tmp_path):
    """FSDP2 over PEFT at world size 2 (gloo), ranks seeded differently as the trainer
    seeds them: one adapter init on both (else each rank shards its own), so half the
    batch a rank gives the single process's gradient norm; rank 0 publishes the
    adapter, and both ranks reload it."""
    import torch.multiprocessing as mp
    from support.loopback import free_port

    mp.spawn(_lora_rank_main, args=(free_port(), str(tiny_model_dir), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["same"] and r1["same"]
    model = apply_fsdp2(wrap_lora(load_policy(tiny_model_dir), LORA))
    single = train_step(
        model,
        build_optimizer(model, CFG),
        build_micro_batches(_sequences(), [1, -1, 0.5, -0.5], 10_000),
        CFG,
    )
    assert r0["grad_norm"] == pytest.approx(single.grad_norm, rel=1e-4)
    saved = load_file(tmp_path / "v1" / ADAPTER_WEIGHTS)
    assert saved.keys() == adapter_state(model).keys()
