"""FSDP2 on CPU (gloo): train a real tiny Qwen2 one step, every parameter moves, the
published HF checkpoint reloads to the trained tensors; token-weighted accumulation
equals one big batch; two ranks reproduce the single-process step exactly."""

from __future__ import annotations

import os
import random
import socket
from dataclasses import astuple
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from areal_service.config import TrainerConfig
from areal_service.types import TrainSequence
from trainer.batch import build_micro_batches
from trainer.model import (
    apply_fsdp2,
    destroy_distributed,
    full_state_dict,
    init_distributed,
    load_policy,
    resolve_dtype,
    save_hf_checkpoint,
)
from trainer.step import accumulate_gradients, build_optimizer, train_step

CFG = TrainerConfig(lr=1e-3, weight_decay=0.0, grad_clip=1.0, max_tokens_per_mb=10_000)


def _sequences(n: int = 4, seed: int = 0) -> list[TrainSequence]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        n_prompt, n_out = rng.randint(3, 8), rng.randint(4, 10)
        ids = tuple(rng.randrange(600) for _ in range(n_prompt + n_out))
        mask = (0,) * n_prompt + (1,) * n_out
        out.append(
            TrainSequence(
                session_id=f"s{i}",
                group_id="g",
                completion_ids=(f"c{i}",),
                input_ids=ids,
                loss_mask=mask,
                # stale-looking behaviour logprobs so w != 1 and the cap matters
                logprobs=tuple(-6.0 - 0.1 * k if m else 0.0 for k, m in enumerate(mask)),
                versions=tuple(0 if m else -1 for m in mask),
                reward=float(i % 2),
            )
        )
    return out


ADVS = [1.0, -1.0, 0.5, -0.5]


@pytest.fixture
def group():
    """A world-size-1 process group, torn down after the test."""
    destroy_distributed()
    info = init_distributed("cpu")
    yield info
    destroy_distributed()


def test_init_distributed_is_idempotent(group):
    assert (group.rank, group.world_size) == (0, 1)
    assert dist.get_backend() == "gloo"
    assert init_distributed("cpu") == group
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16


def test_train_step_changes_every_parameter_and_checkpoint_reloads(group, tiny_model_dir, tmp_path):
    model = apply_fsdp2(load_policy(tiny_model_dir), mixed_precision=False)
    before = {k: v.clone() for k, v in full_state_dict(model).items()}
    optimizer = build_optimizer(model, CFG)
    mbs = build_micro_batches(_sequences(), ADVS, max_tokens_per_mb=30)
    assert len(mbs) >= 2
    stats = train_step(model, optimizer, mbs, CFG)
    assert stats.n_tokens == sum(mb.n_tokens for mb in mbs)
    assert stats.grad_norm > 0 and stats.tokens_per_s > 0 and stats.n_minibatches == 1
    assert stats.importance_weight > 1.0  # behaviour logprobs are far below theta's
    after = full_state_dict(model)
    unchanged = [k for k in after if torch.equal(after[k], before[k])]
    assert unchanged == []

    out = save_hf_checkpoint(model, tiny_model_dir, tmp_path / "weights" / "v1")
    assert sorted(p.name for p in out.parent.iterdir()) == ["v1"]  # temp dir renamed away
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert reloaded.config.architectures == ["Qwen2ForCausalLM"]
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, after[name]), name
    with pytest.raises(FileExistsError):
        save_hf_checkpoint(model, tiny_model_dir, out)


def test_ppo_minibatches_take_one_step_each(group, tiny_model_dir):
    model = apply_fsdp2(load_policy(tiny_model_dir), mixed_precision=False)
    optimizer = build_optimizer(model, CFG)
    mbs = build_micro_batches(_sequences(), ADVS, max_tokens_per_mb=20)
    cfg = CFG.model_copy(update={"ppo_minibatches": 2})
    stats = train_step(model, optimizer, mbs, cfg)
    assert stats.n_minibatches == 2
    assert {int(s["step"]) for s in optimizer.state.values()} == {2}


def test_accumulated_grads_equal_one_big_batch(tiny_model_dir):
    model = load_policy(tiny_model_dir)
    seqs = _sequences()
    one = build_micro_batches(seqs, ADVS, max_tokens_per_mb=10_000)
    split = build_micro_batches(seqs, ADVS, max_tokens_per_mb=30)
    assert len(one) == 1 and len(split) >= 2
    loss_one, stats_one = accumulate_gradients(model, one, CFG)
    grads_one = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss_split, stats_split = accumulate_gradients(model, split, CFG)
    assert loss_split == pytest.approx(loss_one, rel=1e-5)
    assert astuple(stats_split.summary()) == pytest.approx(astuple(stats_one.summary()))
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads_one[n], rtol=1e-4, atol=1e-7), n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    info = init_distributed("cpu")
    model = apply_fsdp2(load_policy(model_dir), mixed_precision=False)
    seqs = _sequences()[rank::2]
    mbs = build_micro_batches(seqs, ADVS[rank::2], max_tokens_per_mb=10_000)
    stats = train_step(model, build_optimizer(model, CFG), mbs, CFG)
    state = full_state_dict(model)
    torch.save(
        {"stats": stats, "state": state, "world": info.world_size}, Path(out_dir) / f"rank{rank}.pt"
    )
    destroy_distributed()


def test_two_ranks_match_one_process(group, tiny_model_dir, tmp_path):
    mp.spawn(_rank_main, args=(_free_port(), str(tiny_model_dir), str(tmp_path)), nprocs=2)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert r0["world"] == r1["world"] == 2
    assert r0["stats"].loss == r1["stats"].loss
    assert r1["state"] == {}  # the full state is gathered on rank 0 only

    model = apply_fsdp2(load_policy(tiny_model_dir), mixed_precision=False)
    mbs = build_micro_batches(_sequences(), ADVS, max_tokens_per_mb=10_000)
    single = train_step(model, build_optimizer(model, CFG), mbs, CFG)
    assert r0["stats"].loss == pytest.approx(single.loss, rel=1e-5)
    # the pre-clip norm catches a wrong cross-rank scale, which Adam's update would hide
    assert r0["stats"].grad_norm == pytest.approx(single.grad_norm, rel=1e-4)
    assert r0["stats"].n_tokens == single.n_tokens
    # Adam's first step is about lr * sign(g): float noise in a near-zero gradient moves
    # a few elements by up to ~0.5% of lr, hence atol = 1% of lr.
    for name, tensor in full_state_dict(model).items():
        assert torch.allclose(r0["state"][name], tensor, atol=0.01 * CFG.lr), name


@pytest.mark.gpu
def test_cuda_bf16_mixed_precision_step(tiny_model_dir, tmp_path):
    destroy_distributed()
    info = init_distributed()
    try:
        assert dist.get_backend() == "nccl" and info.device.type == "cuda"
        model = apply_fsdp2(load_policy(tiny_model_dir), mixed_precision=True)
        before = {k: v.clone() for k, v in full_state_dict(model).items()}
        mbs = [mb.to(info.device) for mb in build_micro_batches(_sequences(), ADVS, 30)]
        stats = train_step(model, build_optimizer(model, CFG), mbs, CFG)
        assert stats.skipped_steps == 0 and stats.grad_norm > 0
        after = full_state_dict(model)
        assert all(v.dtype == torch.float32 for v in after.values())  # fp32 master weights
        assert [k for k in after if torch.equal(after[k], before[k])] == []
        out = save_hf_checkpoint(model, tiny_model_dir, tmp_path / "v1")
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        for name, tensor in reloaded.state_dict().items():
            assert torch.equal(tensor, after[name]), name
    finally:
        destroy_distributed()
