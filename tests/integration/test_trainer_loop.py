"""The trainer loop against real parts: episodes through the real gateway and engine,
training on CPU (gloo, world size 1) with a KL penalty, publishing, the gateway's syncer
swapping the engine, whose logprobs then equal the trainer's own recomputation; a trainer subprocess SIGKILLed mid-run and restarted that resumes and never
trains an episode twice; checkpoint round trips at world size 1 and 2 (gloo); the
recovery rules; equal micro-batch counts across ranks."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from support.harness import ADMIN_KEY, run_gateway
from support.trainer_run import train_in_thread
from support.weight_checks import served_sequence, trainer_logprobs

from areal_service.config import TrainerConfig, load_config
from areal_service.store import TrajectoryStore
from areal_service.store.claims import EpisodeClaimer
from areal_service.types import (
    CompletionRecord,
    EpisodeGroup,
    RewardRecord,
    SessionRecord,
    TrainSequence,
    TrainStepRecord,
    WeightVersionRecord,
)
from engine.testing import make_weight_variant, start_engine_in_thread
from trainer.batch import build_micro_batches
from trainer.checkpoint import (
    CheckpointState,
    load_published_weights,
    restore_checkpoint,
    save_checkpoint,
)
from trainer.metrics import METRIC_NAMES
from trainer.model import (
    DistInfo,
    apply_fsdp2,
    destroy_distributed,
    full_state_dict,
    init_distributed,
    load_policy,
)
from trainer.resume import newer_published_weights, recover_claims, resume_point
from trainer.step import build_optimizer, train_step
from trainer.train import shard_micro_batches

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
ROOT = Path(__file__).resolve().parents[2]


def _episode(gw, key: str, i: int) -> None:
    """Two turns, the second replaying the first (one training sequence when it stopped)."""
    client = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)
    messages = [{"role": "user", "content": f"count to {i}"}]
    first = client.chat.completions.create(model="areal-policy", messages=messages, max_tokens=8)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "again"},
    ]
    client.chat.completions.create(model="areal-policy", messages=messages, max_tokens=8)


def _run_groups(gw, n_groups: int) -> list[str]:
    http = httpx.Client(base_url=gw.url, timeout=60)
    session_ids = []
    for g in range(n_groups):
        started = http.post("/rl/sessions", json={"group_size": 2}, headers=ADMIN)
        assert started.status_code == 201, started.text
        for j, s in enumerate(started.json()["sessions"]):
            _episode(gw, s["api_key"], g)
            reward = http.post(
                "/v1/rewards",
                json={
                    "session_id": s["session_id"],
                    "value": float(j) + 0.25 * g,
                    "end_session": True,
                },
                headers={"authorization": f"Bearer {s['api_key']}"},
            )
            assert reward.status_code == 201, reward.text
            session_ids.append(s["session_id"])
    return session_ids


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_trainer_trains_publishes_and_engine_swaps(tmp_path, tiny_model_dir):
    """Two steps with a KL penalty against the initial model; the engine swaps to v2 and
    its logprobs equal the trainer's forward_logprobs on the v2 weights."""
    overrides = (
        "trainer.group_size=2",
        "trainer.batch_groups=2",
        "trainer.lr=1e-3",
        "trainer.total_steps=2",
        "gateway.sessions.staleness_gate=false",
        "trainer.kl_coef=0.05",
        "trainer.mismatch_mask=sequence",
    )
    with (
        start_engine_in_thread(tiny_model_dir) as engine,
        run_gateway(tmp_path, tiny_model_dir, [engine], *overrides) as gw,
    ):
        sessions = _run_groups(gw, n_groups=4)
        train_in_thread(gw.config, timeout_s=120)

        store = gw.state.store
        steps = store.list_train_steps()
        assert [(s.step, s.version) for s in steps] == [(1, 1), (2, 2)]
        for row in steps:
            assert set(METRIC_NAMES) <= set(row.metrics), set(METRIC_NAMES) - set(row.metrics)
            assert row.metrics["episodes"] == 4 and row.metrics["dropped_episodes"] == 0
            assert row.metrics["advantage"] > 0 and row.metrics["tokens_per_s"] > 0
            assert row.metrics["mismatch_masked_ratio"] == 0  # MIS on, nothing far off
        assert steps[1].metrics["staleness_max"] == 1  # batch 2 was sampled by v0
        # Engine and trainer agree on v0's logprobs; step 2 adds v0 -> v1's drift.
        assert 0 <= steps[0].metrics["mismatch_kl"] < 1e-3 < steps[1].metrics["mismatch_kl"]
        # The reference is v0: step 1 trains v0 itself (KL 0), step 2 trains v1 != v0.
        assert steps[0].metrics["ref_kl"] == pytest.approx(0.0, abs=1e-7)
        assert steps[1].metrics["ref_kl"] > 1e-6
        assert all(store.get_session(s).status == "trained" for s in sessions)
        audit = store.episode_audit(gw.config.trainer)
        assert audit.unaccounted == 0 and audit.states["trained"] == len(sessions)

        initial = load_file(tiny_model_dir / "model.safetensors")
        trained = load_file(tmp_path / "weights" / "v2" / "model.safetensors")
        assert initial.keys() == trained.keys()
        unchanged = [k for k in initial if initial[k].equal(trained[k])]
        assert not unchanged, f"parameters not trained: {unchanged}"
        assert (tmp_path / "checkpoints" / "latest").read_text() == "step-2"
        run_dir = tmp_path / "runs" / "train"
        assert (run_dir / "config.json").is_file() and list(run_dir.glob("events.out.tfevents.*"))

        # The gateway's syncer swaps the engine to v2; new tokens carry version 2.
        _wait(
            lambda: httpx.get(f"{engine}/model_info").json()["weight_version"] == "2",
            30,
            "the engine to serve v2",
        )
        key = httpx.post(f"{gw.url}/rl/sessions", json={}, headers=ADMIN).json()["api_key"]
        client = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)
        replies = [
            client.chat.completions.create(
                model="areal-policy",
                messages=[{"role": "user", "content": f"hi {t}"}],
                max_tokens=12,
                temperature=t,
            )
            for t in (1.0, 0.7)
        ]
        served = [served_sequence(store, r.id) for r in replies]
        for seq in served:
            assert {v for v in seq.versions if v >= 0} == {2}
        assert "swap_s" in store.get_weight_version(2).metadata

    # The trainer's recomputation on the published v2 weights reproduces the engine's
    # logprobs (fp32 CPU); on v0 it does not, so this compares the swapped-in weights.
    trainer_v2, engine_v2 = trainer_logprobs(tmp_path / "weights" / "v2", served)
    assert engine_v2.numel() == sum(r.usage.completion_tokens for r in replies) > 2
    assert float((trainer_v2 - engine_v2).abs().max()) <= 1e-4
    trainer_v0, _ = trainer_logprobs(tiny_model_dir, served)
    assert float((trainer_v0 - engine_v2).abs().max()) > 1e-3


# ---- kill and restart -----------------------------------------------------------------

N_GROUPS = 6


def _seed_episodes(store: TrajectoryStore, groups: range) -> list[str]:
    """Finished, rewarded two-session groups written straight into the store (what the
    gateway records; no engine needed to test the trainer's recovery)."""
    ids = []
    for g in groups:
        group = f"grp_{g}"
        for j in range(2):
            sid = f"sess_{g}_{j}"
            store.add_session(SessionRecord(id=sid, group_id=group))
            prompt = tuple(range(10 + g, 22 + g))
            output = tuple(range(40 + j, 48 + j))
            store.add_completion(
                CompletionRecord(
                    id=f"chatcmpl-{uuid.uuid4().hex}",
                    model="areal-policy",
                    prompt_ids=prompt,
                    output_ids=output,
                    output_logprobs=(-3.0,) * len(output),
                    output_versions=(0,) * len(output),
                    finish_reason="stop",
                    session_id=sid,
                )
            )
            store.add_reward(RewardRecord(id=f"r-{sid}", value=float(j), session_id=sid))
            store.end_session(sid, "reward")
            ids.append(sid)
    return ids


def _trainer(data_dir: Path, model_dir: Path, log_path: Path, *extra: str) -> subprocess.Popen:
    sets = [
        f"data_dir={data_dir}",
        f"engine.model={model_dir}",
        "trainer.group_size=2",
        "trainer.batch_groups=1",
        "trainer.lr=1e-3",
        "trainer.checkpoint_every=1",
        # every seeded episode was sampled by v0 and must stay trainable
        f"trainer.max_staleness={N_GROUPS}",
        *extra,
    ]
    argv = [sys.executable, "-m", "trainer.train"]
    for item in sets:
        argv += ["--set", item]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AREAL_")}
    with log_path.open("wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def test_killed_trainer_resumes_and_never_trains_twice(tmp_path, tiny_model_dir):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    config = load_config(overrides=[f"data_dir={data_dir}"])
    store = TrajectoryStore.open(config.database_url(), config.store)
    # The first trainer gets half the episodes, so it is killed (at whatever point it
    # reached: training, publishing, marking, checkpointing or waiting) before the end.
    sessions = _seed_episodes(store, range(N_GROUPS // 2))
    first = _trainer(
        data_dir, tiny_model_dir, tmp_path / "first.log", f"trainer.total_steps={N_GROUPS}"
    )
    try:
        checkpointed = data_dir / "checkpoints" / "latest"
        _wait(
            lambda: first.poll() is not None or checkpointed.exists(),
            90,
            "the first trainer's first checkpoint",
        )
        assert first.poll() is None, (tmp_path / "first.log").read_text()
        first.send_signal(signal.SIGKILL)  # our own child, by handle
    finally:
        first.kill()
        first.wait(30)
    sessions += _seed_episodes(store, range(N_GROUPS // 2, N_GROUPS))

    # Online mode (no total_steps): trains what is left, then waits until SIGTERM.
    second = _trainer(data_dir, tiny_model_dir, tmp_path / "second.log")
    try:
        _wait(
            lambda: (
                second.poll() is not None or store.count_sessions(status="trained") == len(sessions)
            ),
            120,
            "the second trainer to train every session",
        )
        assert second.poll() is None, (tmp_path / "second.log").read_text()
        second.send_signal(signal.SIGTERM)  # finishes the step in hand, then exits 0
        assert second.wait(60) == 0, (tmp_path / "second.log").read_text()
    finally:
        second.kill()
        second.wait(30)
    log = (tmp_path / "second.log").read_text()
    assert "restored checkpoint step" in log, log

    versions = sorted(store.list_weight_versions(), key=lambda v: v.version)
    assert [v.version for v in versions] == list(range(1, N_GROUPS + 1))
    assert [v.metadata["step"] for v in versions] == list(range(1, N_GROUPS + 1))
    trained = [s for v in versions for ids in v.metadata["episodes"].values() for s in ids]
    assert sorted(trained) == sorted(sessions), "an episode was trained twice or never"
    assert all(store.get_session(s).status == "trained" for s in sessions)
    steps = store.list_train_steps()
    assert all(s.step == s.version for s in steps)
    assert steps[-1].step == N_GROUPS and len(steps) >= N_GROUPS - 1  # a kill may lose one row
    latest = (data_dir / "checkpoints" / "latest").read_text()
    assert latest == f"step-{N_GROUPS}"
    assert sorted(p.name for p in (data_dir / "weights").iterdir()) == ["v4", "v5", "v6"]
    store.close()


# ---- checkpoint round trip, recovery rules, rank sharding -----------------------------

CFG = TrainerConfig(lr=1e-3, weight_decay=0.0, max_tokens_per_mb=10_000)


def _sequences(n: int = 4) -> list[TrainSequence]:
    out = []
    for i in range(n):
        ids = tuple((7 * i + 3 * k) % 600 for k in range(6 + 2 * i))
        mask = (0,) * 3 + (1,) * (len(ids) - 3)
        out.append(
            TrainSequence(
                session_id=f"s{i}",
                group_id="g",
                completion_ids=(f"c{i}",),
                input_ids=ids,
                loss_mask=mask,
                logprobs=tuple(-4.0 * m for m in mask),
                versions=tuple(0 if m else -1 for m in mask),
                reward=float(i % 2),
            )
        )
    return out


def _roundtrip(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """Train a step, checkpoint, train another (A); restore into a fresh model and
    optimizer, train the same step (B). A == B only if model, Adam state and RNG all
    came back."""
    if world > 1:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
        )
        torch.set_num_threads(1)
    info = init_distributed("cpu")
    info = dataclasses.replace(info, device=torch.device("cpu"))
    seqs = _sequences(2)
    groups = [EpisodeGroup("g", ("s0", "s1"), tuple(seqs), (0.0, 1.0), 0)]
    mbs = shard_micro_batches(groups, [[1.0, -1.0]], 8, info)  # two rows

    def fresh():
        model = apply_fsdp2(load_policy(model_dir), mixed_precision=False)
        return model, build_optimizer(model, CFG)

    model, optimizer = fresh()
    train_step(model, optimizer, mbs, CFG)
    save_checkpoint(model, optimizer, checkpoint_dir=Path(out_dir), step=7, version=9)
    after_save = torch.rand(4)
    train_step(model, optimizer, mbs, CFG)
    continued = full_state_dict(model)

    model, optimizer = fresh()
    state = restore_checkpoint(model, optimizer, Path(out_dir))
    after_restore = torch.rand(4)
    train_step(model, optimizer, mbs, CFG)
    resumed = full_state_dict(model)
    torch.save(
        {
            "state": state,
            "rng": (after_save, after_restore),
            "continued": continued,
            "resumed": resumed,
            "n_mbs": len(mbs),
        },
        Path(out_dir) / f"rank{rank}.pt",
    )
    if world > 1:
        destroy_distributed()


# World size 2 spawns two processes that import torch, transformers and this module
# (~40 s on two busy cores): `slow`, run with `-m slow`.
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_checkpoint_restores_model_optimizer_and_rng(world, tiny_model_dir, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    if world == 1:
        destroy_distributed()
        try:
            _roundtrip(0, 1, 0, str(tiny_model_dir), str(ckpt_dir))
        finally:
            destroy_distributed()
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_roundtrip, args=(world, port, str(tiny_model_dir), str(ckpt_dir)), nprocs=world)
    results = [torch.load(ckpt_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r in results:
        assert (r["state"].step, r["state"].version) == (7, 9)
        assert torch.equal(*r["rng"])  # every rank's RNG continues where it was saved
    assert len({r["n_mbs"] for r in results}) == 1  # same micro-batch count on every rank
    continued, resumed = results[0]["continued"], results[0]["resumed"]
    assert continued.keys() == resumed.keys() and continued
    for name in continued:
        assert torch.equal(continued[name], resumed[name]), name
    assert (ckpt_dir / "latest").read_text() == "step-7"


def test_shard_micro_batches_pads_every_rank_to_the_same_count():
    seqs = _sequences(3)
    groups = [EpisodeGroup("g", ("s0", "s1", "s2"), tuple(seqs), (0.0, 1.0, 2.0), 0)]
    advs = [[1.0, -1.0, 0.5]]
    rows = build_micro_batches(seqs, advs[0], 12)
    assert len(rows) == 3
    shards = [
        shard_micro_batches(groups, advs, 12, DistInfo(r, 2, r, torch.device("cpu")))
        for r in range(2)
    ]
    assert [len(s) for s in shards] == [2, 2]
    filler = shards[1][1]
    assert filler.n_tokens == 1 and filler.advantages.tolist() == [0.0]
    assert filler.targets.item() == seqs[0].input_ids[3]  # a real token of a real sequence
    trained = sorted(mb.n_tokens for s in shards for mb in s)
    assert sum(trained) == sum(mb.n_tokens for mb in rows) + 1


def test_recover_claims_and_resume_point(tmp_path):
    config = load_config(overrides=[f"data_dir={tmp_path}"])
    store = TrajectoryStore.open(config.database_url(), config.store)
    _seed_episodes(store, range(3))
    claimer = EpisodeClaimer(store)
    claimed = claimer.claim_groups(
        group_size=2, max_groups=3, current_version=0, max_staleness=None, claimer="dead-trainer"
    ).groups
    published, lost, kept = claimed
    claimer.mark_trained(kept.claim_id)
    # v1 committed `published` but the trainer died before mark_trained; `lost` was
    # being trained when it died.
    store.add_weight_version(
        WeightVersionRecord(
            1,
            str(tmp_path / "v1"),
            metadata={"step": 1, "episodes": {published.claim_id: list(published.session_ids)}},
        )
    )
    assert recover_claims(store, claimer) == (2, 2)
    assert {store.get_session(s).status for s in published.session_ids} == {"trained"}
    assert {store.get_session(s).status for s in lost.session_ids} == {"ended"}
    assert {store.get_session(s).status for s in kept.session_ids} == {"trained"}

    assert resume_point(store, None) == (1, 1)
    assert resume_point(store, CheckpointState(step=4, version=6, path=tmp_path)) == (4, 6)
    store.add_train_step(TrainStepRecord(step=5, version=1))
    assert resume_point(store, CheckpointState(step=4, version=0, path=tmp_path)) == (5, 1)
    # The store is ahead of the checkpoint: the model resumes from the published weights
    # when they are still on disk.
    behind = CheckpointState(step=0, version=0, path=tmp_path)
    assert newer_published_weights(store, behind) is None  # v1's directory is gone
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "config.json").write_text("{}")
    assert newer_published_weights(store, behind) == tmp_path / "v1"
    assert newer_published_weights(store, CheckpointState(1, 1, tmp_path)) is None
    store.close()


def test_published_weights_load_into_the_sharded_policy(tiny_model_dir, tmp_path):
    variant = make_weight_variant(tiny_model_dir, tmp_path / "v3", seed=3)
    destroy_distributed()
    try:
        init_distributed("cpu")
        model = apply_fsdp2(load_policy(tiny_model_dir), mixed_precision=False)
        before = {k: v.clone() for k, v in full_state_dict(model).items()}  # CPU: aliases
        load_published_weights(model, variant)
        after = full_state_dict(model)
    finally:
        destroy_distributed()
    expected = load_policy(variant).state_dict()
    assert after.keys() == before.keys()
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert changed, "the variant's weights were not loaded"
    for name, tensor in after.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
