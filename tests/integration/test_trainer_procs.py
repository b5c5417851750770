"""The trainer in two processes: `python -m torch.distributed.run --nproc-per-node 2 -m
trainer.train` (FSDP2 over gloo on CPU), end to end against a real SQLite store, next to
the same trainer in one process on an identical copy of the store:

- claims once: one version row per step listing the batch's claims, every session
  trained exactly once;
- the same result: the published weights of both runs agree within float tolerance
  (the gradient is the token mean over the whole batch however it was split);
- publishes once: v1 only (one row, one `weights/v1`), not one per rank;
- resumes: a second 2-process run continues from step 1 to step 2 on new episodes.

Prints tokens/s per process of both runs (the train step only; same batch)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from areal_service.config import load_config
from areal_service.store import TrajectoryStore
from areal_service.types import CompletionRecord, RewardRecord, SessionRecord

ROOT = Path(__file__).resolve().parents[2]
GROUPS = 4


def _seed(data_dir: Path, groups: range) -> list[str]:
    """Finished, rewarded two-session groups with deterministic ids (both copies of the
    store get the same rows, so both trainers claim the same batch)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    config = load_config(overrides=[f"data_dir={data_dir}"])
    store = TrajectoryStore.open(config.database_url(), config.store)
    ids = []
    try:
        for g in groups:
            for j in range(2):
                sid = f"sess_{g}_{j}"
                store.add_session(SessionRecord(id=sid, group_id=f"grp_{g}"))
                prompt = tuple(range(10 + 3 * g, 30 + 3 * g))
                output = tuple(range(40 + 5 * j + g, 56 + 5 * j + g))
                store.add_completion(
                    CompletionRecord(
                        id=f"chatcmpl-{g:03d}{j}",
                        model="areal-policy",
                        prompt_ids=prompt,
                        output_ids=output,
                        output_logprobs=(-3.0,) * len(output),
                        output_versions=(0,) * len(output),
                        finish_reason="stop",
                        session_id=sid,
                    )
                )
                store.add_reward(
                    RewardRecord(id=f"r-{sid}", value=float(j) + 0.1 * g, session_id=sid)
                )
                store.end_session(sid, "reward")
                ids.append(sid)
    finally:
        store.close()
    return ids


def _train(
    data_dir: Path, model_dir: Path, log: Path, *, procs: int, steps: int, timeout_s: float = 240
) -> str:
    sets = [
        f"data_dir={data_dir}",
        f"engine.model={model_dir}",
        "trainer.group_size=2",
        f"trainer.batch_groups={GROUPS}",
        "trainer.lr=1e-3",
        "trainer.checkpoint_every=1",
        "trainer.max_staleness=10",
        f"trainer.total_steps={steps}",
        "trainer.torch_threads=1",
        "trainer.max_tokens_per_mb=80",
    ]  # several micro-batches, split across ranks
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={procs}",
        "-m",
        "trainer.train",
    ]
    for item in sets:
        argv += ["--set", item]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AREAL_")}
    env["OMP_NUM_THREADS"] = "1"
    with log.open("wb") as out:
        proc = subprocess.run(
            argv,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return text


def _store(data_dir: Path) -> TrajectoryStore:
    config = load_config(overrides=[f"data_dir={data_dir}"])
    return TrajectoryStore.open(config.database_url(), config.store)


def test_two_process_trainer_matches_one_process_and_resumes(tmp_path, tiny_model_dir):
    one, two = tmp_path / "one", tmp_path / "two"
    sessions = _seed(one, range(GROUPS))
    assert _seed(two, range(GROUPS)) == sessions
    # Both runs at once (the box has two cores; each process gets one intra-op thread).
    with cf.ThreadPoolExecutor(2) as pool:
        futures = {
            name: pool.submit(_train, d, tiny_model_dir, tmp_path / f"{name}.log", procs=p, steps=1)
            for name, d, p in (("one", one, 1), ("two", two, 2))
        }
        logs = {name: f.result() for name, f in futures.items()}
    assert "[rank1]" in logs["two"] and "[rank1]" not in logs["one"]

    results = {}
    for name, data_dir in (("one", one), ("two", two)):
        store = _store(data_dir)
        try:
            versions = store.list_weight_versions()
            assert [v.version for v in versions] == [1], "published once"
            trained = [s for ids in versions[0].metadata["episodes"].values() for s in ids]
            assert sorted(trained) == sorted(sessions), "every session, once"
            assert all(store.get_session(s).status == "trained" for s in sessions)
            (step,) = store.list_train_steps()
            results[name] = step.metrics
        finally:
            store.close()
        assert sorted(p.name for p in (data_dir / "weights").iterdir()) == ["v1"]

    w1 = load_file(one / "weights" / "v1" / "model.safetensors")
    w2 = load_file(two / "weights" / "v1" / "model.safetensors")
    w0 = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert w1.keys() == w2.keys()
    moved = max(float((w1[k] - w0[k]).abs().max()) for k in w1)
    diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    assert moved > 1e-4, "the step changed the weights"
    assert diff <= 1e-5 + 1e-3 * moved, f"1 vs 2 processes differ by {diff} (moved {moved})"
    for key in ("loss", "grad_norm", "entropy", "importance_weight", "task_reward"):
        assert abs(results["one"][key] - results["two"][key]) <= 1e-4 * max(
            1.0, abs(results["one"][key])
        ), (key, results["one"][key], results["two"][key])
    per_proc_1 = results["one"]["tokens_per_s"]
    per_proc_2 = results["two"]["tokens_per_s"] / 2
    print(
        "\ntrain step tokens/s per process, same batch "
        f"(run side by side): 1 process {per_proc_1:.0f}, "
        f"2 processes {per_proc_2:.0f} ({per_proc_2 / per_proc_1:.2f}x)"
    )

    # Resume: new episodes, a second 2-process run continues from step 1.
    more = _seed(two, range(GROUPS, 2 * GROUPS))
    log = _train(two, tiny_model_dir, tmp_path / "resume.log", procs=2, steps=2)
    assert "restored checkpoint step 1" in log or "trainer starts after step 1" in log, log[-3000:]
    store = _store(two)
    try:
        versions = sorted(store.list_weight_versions(), key=lambda v: v.version)
        assert [v.version for v in versions] == [1, 2]
        assert [v.metadata["step"] for v in versions] == [1, 2]
        second = [s for ids in versions[1].metadata["episodes"].values() for s in ids]
        assert sorted(second) == sorted(more), "the resumed step trained only new episodes"
        assert all(store.get_session(s).status == "trained" for s in sessions + more)
    finally:
        store.close()
    assert torch.isfinite(torch.tensor(results["two"]["loss"]))
