"""FSDP2 on CPU (gloo): train a real tiny Qwen2 one step, every parameter moves, the
published HF checkpoint reloads to the trained tensors; token-weighted accumulation
equals one big batch; two ranks reproduce the single-process gradient and step; the
KL penalty against a frozen, sharded reference model; the config's upper clip reaches
the step."""

from __future__ import annotations

import math
import os
import random
from dataclasses import astuple, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.loopback import free_port
from torch.distributed.fsdp import FSDPModule
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
    load_reference,
    resolve_dtype,
    save_hf_checkpoint,
    shard_or_keep,
)
from trainer.policy import reference_model
from trainer.step import (
    accumulate_gradients,
    build_optimizer,
    compute_logprobs,
    forward_logprobs,
    train_step,
)

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


def test_tied_head_file_for_vllm_holds_the_trained_embedding(group, tiny_model_dir, tmp_path):
    """vLLM's in-place reload keeps a tied head's old weights unless the head is stored
    as a tensor: the trainer writes it beside the checkpoint, equal to the embedding it
    trained, and HF still loads the checkpoint as before (without that file)."""
    from safetensors.torch import load_file

    from gateway.backends.vllm import tied_head_missing
    from trainer.model import TIED_HEAD_FILE

    model = apply_fsdp2(load_policy(tiny_model_dir), mixed_precision=False)
    train_step(
        model,
        build_optimizer(model, CFG),
        build_micro_batches(_sequences(), ADVS, max_tokens_per_mb=10_000),
        CFG,
    )
    plain = save_hf_checkpoint(model, tiny_model_dir, tmp_path / "plain")
    out = save_hf_checkpoint(model, tiny_model_dir, tmp_path / "v1", tied_head_file=True)
    assert not (plain / TIED_HEAD_FILE).exists() and tied_head_missing(plain)
    assert not tied_head_missing(out)
    head = load_file(out / TIED_HEAD_FILE)
    trained = full_state_dict(model)["model.embed_tokens.weight"]
    assert set(head) == {"lm_head.weight"} and torch.equal(head["lm_head.weight"], trained)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(reloaded.lm_head.weight, trained)


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


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def test_reference_model_is_loaded_only_for_a_kl_penalty(group, tiny_model_dir, tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    assert (
        reference_model(TrainerConfig(ref_model=str(missing)), missing, mixed_precision=False)
        is None
    )  # kl_coef = 0: nothing read
    with pytest.raises(OSError):
        reference_model(
            TrainerConfig(kl_coef=0.1, ref_model=str(missing)),
            tiny_model_dir,
            mixed_precision=False,
        )
    ref = reference_model(TrainerConfig(kl_coef=0.1), tiny_model_dir, mixed_precision=False)
    # one float32 process: the plain module, as the policy's (`shard_or_keep`)
    assert not isinstance(ref, FSDPModule) and not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    sharded = shard_or_keep(load_policy(tiny_model_dir), mixed_precision=True)
    assert isinstance(sharded, FSDPModule)  # bf16 mixed precision: FSDP2's policy
    assert all(type(p).__name__ == "DTensor" for p in sharded.parameters())


def _sequence_logprobs(model, seq: TrainSequence) -> list[float]:
    """Unpacked, unsharded reference: log softmax of a plain forward at trained tokens."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq.input_ids])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return [
        float(logp[k - 1, seq.input_ids[k]])
        for k in range(1, len(seq.input_ids))
        if seq.loss_mask[k]
    ]


def test_kl_penalty_against_a_frozen_reference(group, tiny_model_dir):
    kl_cfg = CFG.model_copy(update={"kl_coef": 1.0})
    model = apply_fsdp2(load_policy(tiny_model_dir), mixed_precision=False)
    optimizer = build_optimizer(model, kl_cfg)
    ref = load_reference(tiny_model_dir)
    seqs = _sequences()
    mbs = build_micro_batches(seqs, ADVS, max_tokens_per_mb=30)
    assert len(mbs) >= 2
    with pytest.raises(ValueError, match="kl_coef"):
        train_step(model, optimizer, mbs, kl_cfg)  # a penalty with no reference

    # v0: the policy is the reference, so the KL and its gradient are 0.
    first = train_step(model, optimizer, mbs, kl_cfg, ref_model=ref)
    assert first.ref_kl == pytest.approx(0.0, abs=1e-7)

    # One update later the policy differs from the reference: the penalty changes the
    # gradient by exactly the gradient of the KL term alone (advantages 0).
    with_ref = [
        replace(mb, ref_logprobs=lp) for mb, lp in zip(mbs, compute_logprobs(ref, mbs), strict=True)
    ]
    accumulate_gradients(model, with_ref, CFG)
    g_off = _grads(model)
    accumulate_gradients(model, with_ref, kl_cfg)
    g_on = _grads(model)
    no_adv = [replace(mb, advantages=torch.zeros_like(mb.advantages)) for mb in with_ref]
    accumulate_gradients(model, no_adv, kl_cfg)
    g_kl = _grads(model)
    delta = sum(float((g_on[n] - g_off[n]).norm() ** 2) for n in g_on) ** 0.5
    assert delta > 1e-3 * sum(float(g.norm() ** 2) for g in g_off.values()) ** 0.5
    for n in g_on:  # to float32 cancellation noise, relative to the tensor's largest entry
        tol = 1e-5 * float(g_off[n].abs().max())
        assert torch.allclose(g_on[n] - g_off[n], g_kl[n], rtol=1e-4, atol=tol), n

    # ref_kl of the step is the token mean of exp(ref - theta) - (ref - theta) - 1, from
    # plain unpacked forwards of the policy's current weights and of the reference.
    plain_policy = load_policy(tiny_model_dir)
    plain_policy.load_state_dict(full_state_dict(model))
    plain_ref = load_policy(tiny_model_dir)
    k3 = []
    for seq in seqs:
        theta, pref = _sequence_logprobs(plain_policy, seq), _sequence_logprobs(plain_ref, seq)
        k3 += [math.exp(r - t) - (r - t) - 1 for t, r in zip(theta, pref, strict=True)]
    second = train_step(model, optimizer, mbs, kl_cfg, ref_model=ref)
    assert sum(k3) / len(k3) > 1e-6
    assert second.ref_kl == pytest.approx(sum(k3) / len(k3), rel=1e-3)


def test_config_upper_clip_reaches_the_step(group, tiny_model_dir):
    """With pi_prox 0.25 nats below theta (ratio e^0.25 = 1.28) and positive advantages,
    eps_clip 0.2 clips every token (no gradient) while eps_clip_higher 0.3 does not."""
    model = apply_fsdp2(load_policy(tiny_model_dir), mixed_precision=False)
    mbs = build_micro_batches(_sequences(), [1.0] * 4, max_tokens_per_mb=10_000)
    mbs = [replace(mb, prox_logprobs=forward_logprobs(model, mb)[0].detach() - 0.25) for mb in mbs]
    cap_off = {"behav_imp_weight_cap": None}
    _, clipped = accumulate_gradients(model, mbs, CFG.model_copy(update=cap_off))
    assert clipped.summary().clip_ratio == 1.0
    assert all(float(g.abs().max()) == 0.0 for g in _grads(model).values())
    higher = CFG.model_copy(update={**cap_off, "eps_clip_higher": 0.3})
    _, free = accumulate_gradients(model, mbs, higher)
    assert free.summary().clip_ratio == 0.0
    assert max(float(g.abs().max()) for g in _grads(model).values()) > 0.0


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's unsharded gradient (collective under FSDP2: all ranks call)."""
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


def _rank_main(rank: int, port: int, model_dir: str, out_dir: str, cfg: TrainerConfig) -> None:
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
    mbs = build_micro_batches(seqs, ADVS[rank::2], max_tokens_per_mb=cfg.max_tokens_per_mb)
    accumulate_gradients(model, mbs, cfg)
    grads = _full_grads(model)
    model.zero_grad(set_to_none=True)
    stats = train_step(model, build_optimizer(model, cfg), mbs, cfg)
    state = full_state_dict(model)
    torch.save(
        {"stats": stats, "state": state, "grads": grads, "world": info.world_size},
        Path(out_dir) / f"rank{rank}.pt",
    )
    destroy_distributed()


@pytest.mark.parametrize("sync_every_mb", [True, False], ids=["sync-every-mb", "sync-at-end"])
@pytest.mark.processes
def test_two_ranks_match_one_process(group, tiny_model_dir, tmp_path, sync_every_mb):
    """Half the batch on each of two ranks gives the single process's gradient (the
    token mean over the whole batch: a wrong cross-rank scale fails here) and, where
    that gradient is well above float noise, the same Adam step. Also with gradients
    reduced only after a step's last micro-batch (two micro-batches a rank)."""
    cfg = (
        CFG
        if sync_every_mb
        else CFG.model_copy(update={"grad_sync_every_mb": False, "max_tokens_per_mb": 2})
    )  # a sequence each
    mp.spawn(_rank_main, args=(free_port(), str(tiny_model_dir), str(tmp_path), cfg), nprocs=2)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert r0["world"] == r1["world"] == 2
    assert r0["stats"].loss == r1["stats"].loss
    assert r1["state"] == {}  # the full state is gathered on rank 0 only

    model = apply_fsdp2(load_policy(tiny_model_dir), mixed_precision=False)
    mbs = build_micro_batches(_sequences(), ADVS, max_tokens_per_mb=10_000)
    accumulate_gradients(model, mbs, CFG)
    grads = _full_grads(model)
    model.zero_grad(set_to_none=True)
    single = train_step(model, build_optimizer(model, CFG), mbs, CFG)
    assert r0["stats"].loss == pytest.approx(single.loss, rel=1e-5)
    assert r0["stats"].grad_norm == pytest.approx(single.grad_norm, rel=1e-4)
    assert r0["stats"].n_tokens == single.n_tokens

    # The gradients themselves, to float32 summation-order noise (relative to the
    # largest entry of each tensor; both ranks hold the same full gradient).
    for name, g in grads.items():
        assert torch.equal(r0["grads"][name], r1["grads"][name]), name
        tol = 1e-5 * float(g.abs().max()) + 1e-10
        assert torch.allclose(r0["grads"][name], g, rtol=1e-4, atol=tol), name

    # Adam's first step moves each element by about lr * sign(g): where |g| is at the
    # noise level the sign, hence the update, is arbitrary (up to 2 * lr apart). Compare
    # the parameters where both gradients are exactly 0 (must be untouched alike) or
    # |g| is well above the noise, and check that this covers nearly every element.
    state = full_state_dict(model)
    compared = total = 0
    for name, g in grads.items():
        g2 = r0["grads"][name]
        clear = g.abs() > 1e-4 * float(g.abs().max())
        zero = (g == 0) & (g2 == 0)
        keep = clear | zero
        compared += int(keep.sum())
        total += g.numel()
        got, want = r0["state"][name][keep], state[name][keep]
        assert torch.allclose(got, want, rtol=0, atol=1e-3 * CFG.lr), name
    assert compared / total > 0.99, f"only {compared}/{total} elements compared"


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
