"""The dataset driver (`areal-service train`) and evaluation (`areal-service eval`):
groups over REST with every reward recorded, training through the trainer, resume after
the driver is killed, interrupted groups settled, and the eval table."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from support.loopback import free_port

from areal_service.datasets import DatasetConfig, load_samples
from launcher.dataset_driver import DatasetDriver, DriverState
from launcher.driver_config import DriverConfig
from launcher.processes import cli_argv
from launcher.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
ADMIN = {"authorization": "Bearer sk-test-admin"}


def _driver(gateway, tmp_path: Path, **fields) -> DatasetDriver:
    """A driver object on the test gateway (no children of its own)."""
    dataset = DatasetConfig(path=ROOT / "examples/math/data/train.jsonl", limit=4)
    driver = DriverConfig.model_validate(
        {"dataset": dataset, "reward": "math", "rollout": {"group_size": 2}, **fields}
    )
    stack = Stack(gateway.config, tmp_path)
    state = DriverState(fingerprint={})
    return DatasetDriver(
        driver, gateway.config, load_samples(dataset), stack, state, tmp_path / "state.json"
    )


def _view(gateway, sid: str) -> dict:
    return httpx.get(f"{gateway.url}/rl/sessions/{sid}", headers=ADMIN).json()


def test_groups_rewards_and_agent_failures_over_rest(gateway, tmp_path):
    """A per-completion agent's rewards land on its completions and the session ends; a
    failing agent's episodes are not scored but ended as `failed` (the trainer drops them
    alone); the state records both."""

    async def scenario(agent: str) -> tuple[DatasetDriver, list[str]]:
        d = _driver(gateway, tmp_path, agent=agent)
        try:
            await d.run_group(1, epoch=0)
            return d, d.state.in_flight.get("1", [])
        finally:
            await d.aclose()

    d, left = asyncio.run(scenario("support.driver_agents:per_completion"))
    assert left == [] and d.state.done == [1] and d.state.episodes == 2
    assert d.state.reward_sum == pytest.approx(2 * 0.75)
    groups = httpx.get(f"{gateway.url}/rl/sessions", headers=ADMIN).json()["data"]
    assert len(groups) == 2 and len({s["group_id"] for s in groups}) == 1
    for s in groups:
        view = _view(gateway, s["session_id"])
        assert view["status"] == "ended" and view["end_reason"] == "client"
        assert view["metadata"] == {"source": "dataset-driver", "sample_index": 1, "epoch": 0}
        assert sorted(r["value"] for r in view["rewards"]) == [0.25, 0.5]
        assert {r["completion_id"] for r in view["rewards"]} == {
            c["id"] for c in view["completions"]
        }

    d, _ = asyncio.run(scenario("support.driver_agents:broken"))
    assert d.errors == 2 and d.state.reward_sum == 0.0
    newest = httpx.get(f"{gateway.url}/rl/sessions", headers=ADMIN).json()["data"][:2]
    for s in newest:
        view = _view(gateway, s["session_id"])
        assert view["rewards"] == [] and view["end_reason"] == "failed"
    assert d.state.done == [1]  # a failed group is settled, not rerun


def test_recover_settles_groups_left_in_flight(gateway, tmp_path):
    """A complete group counts as done; a half-scored one has its open session ended as
    `no_reward` (so the trainer drops the group) and its sample runs again."""

    def group() -> list[dict]:
        r = httpx.post(f"{gateway.url}/rl/sessions", headers=ADMIN, json={"group_size": 2})
        return r.json()["sessions"]

    def score(session: dict) -> None:
        r = httpx.post(
            f"{gateway.url}/v1/rewards",
            headers={"authorization": f"Bearer {session['api_key']}"},
            json={"session_id": session["session_id"], "value": 1.0, "end_session": True},
        )
        assert r.status_code == 201, r.text

    complete, partial = group(), group()
    for s in (*complete, partial[0]):
        score(s)
    d = _driver(gateway, tmp_path)
    d.state.in_flight = {
        "0": [s["session_id"] for s in complete],
        "3": [s["session_id"] for s in partial],
    }

    async def recover() -> None:
        try:
            await d.recover()
        finally:
            await d.aclose()

    asyncio.run(recover())
    assert d.state.done == [0] and d.state.in_flight == {} and d.state.episodes == 2
    assert json.loads((tmp_path / "state.json").read_text())["done"] == [0]
    assert _view(gateway, partial[0]["session_id"])["end_reason"] == "reward"
    assert _view(gateway, partial[1]["session_id"])["end_reason"] == "no_reward"


def _train_argv(data_dir: Path, engine_port: int, gateway_port: int) -> list[str]:
    return cli_argv(
        "train",
        "--config",
        str(ROOT / "examples/math/train.yaml"),
        "--set",
        f"data_dir={data_dir}",
        "--set",
        f"engine.port={engine_port}",
        "--set",
        f"gateway.port={gateway_port}",
        "--set",
        "dataset.limit=8",
        "--set",
        "rollout.group_size=2",
        "--set",
        "rollout.batch_size=2",
        "--set",
        "rollout.progress_interval_s=1",
        "--set",
        "gateway.sampling.default_max_tokens=8",
        "--set",
        "trainer.checkpoint_every=2",
        "--set",
        "trainer.lr=1e-4",
    )


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_math_example_trains_and_resumes_after_the_driver_is_killed(tmp_path):
    """The math example (Agents SDK agent, math-verify reward) through
    `areal-service train`: killed outright partway, rerun, it continues from the saved
    position; in the end every sample's group was trained exactly once, every trained
    episode has its reward, and the trainer reached its last step."""
    data = tmp_path / "data"
    ports = (free_port(), free_port())
    argv = _train_argv(data, *ports)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    state_path = data / "driver" / "state.json"
    with (tmp_path / "first.log").open("wb") as log:
        first = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and first.poll() is None:
            if state_path.exists() and len(json.loads(state_path.read_text())["done"]) >= 3:
                break
            time.sleep(0.2)
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        first.send_signal(signal.SIGKILL)
        first.wait()
    before = json.loads(state_path.read_text())
    assert 3 <= len(before["done"]) < 8 and not before["finished"]
    deadline = time.monotonic() + 60  # its children got SIGTERM from the kernel
    while not all(_port_free(p) for p in ports) and time.monotonic() < deadline:
        time.sleep(0.2)

    second = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert f"resuming at epoch 1: {len(before['done'])} samples of this epoch done" in out
    assert "episodes 16/16 (100%)" in out and "trainer at step 4/4" in out
    # After the last episode the wait for the trainer's last steps is said as such (the
    # episode line used to sit at 100% / ETA 0:00:00), and so is stopping the stack.
    assert "all episodes ran; the trainer is finishing its steps (" in second.stdout
    assert "stopping the " in second.stdout
    after = json.loads(state_path.read_text())
    assert after["finished"] and after["episodes"] == 16 and after["in_flight"] == {}

    db = sqlite3.connect(data / "areal.db")
    rows = db.execute(
        "SELECT id, status, end_reason, json_extract(metadata, '$.sample_index') FROM sessions"
    ).fetchall()
    trained = [r for r in rows if r[1] == "trained"]
    # every sample trained once, as one whole group of 2; nothing else trained
    assert sorted(r[3] for r in trained) == sorted(list(range(8)) * 2)
    # interrupted groups (if the kill caught one in flight) were dropped, never trained
    assert all(r[1] == "dropped" for r in rows if r[1] != "trained")
    rewarded = {sid for (sid,) in db.execute("SELECT session_id FROM rewards")}
    assert {r[0] for r in trained} <= rewarded
    assert db.execute("SELECT max(step) FROM train_steps").fetchone() == (4,)

    # a third run has nothing left to do and starts nothing
    third = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert third.returncode == 0 and "nothing to do: all 16 episodes ran" in third.stdout
    assert "started engine" not in third.stderr and "stopping the" not in third.stdout


def test_eval_prints_the_table_on_the_shipped_dataset(tmp_path):
    data = tmp_path / "data"
    dataset = "[{path: examples/math/data/test.jsonl, name: arith-test, limit: 4}]"
    out = subprocess.run(
        cli_argv(
            "eval",
            "--config",
            str(ROOT / "examples/math/eval.yaml"),
            "--set",
            f"data_dir={data}",
            "--set",
            f"engine.port={free_port()}",
            "--set",
            f"gateway.port={free_port()}",
            "--set",
            f"eval.datasets={dataset}",
            "--set",
            "eval.n_samples=3",
            "--set",
            "eval.k=[1,3]",
            "--set",
            "eval.max_tokens=8",
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("dataset "))
    assert lines[header].split() == [
        "dataset",
        "num_questions",
        "greedy_length",
        "sample_length",
        "greedy_acc",
        "sample_pass@1",
        "pass@1",
        "pass@3",
    ]
    row = lines[header + 1].split()
    assert row[:2] == ["arith-test", "4"] and float(row[2]) == 8.0  # untrained: no EOS
    (saved,) = json.loads((data / "eval" / "results.json").read_text())
    assert saved["num_questions"] == 4 and 0.0 <= saved["pass@3"] <= 1.0
    assert (data / "eval" / "results.csv").read_text().startswith("dataset,num_questions,")


def test_eval_through_a_running_gateway(gateway_factory, tiny_model_dir, engine_url, tmp_path):
    """`--gateway URL`: the admin key, no sessions (nothing there is trained on). With
    the gateway honouring client sampling, the built-in agent's greedy runs are
    deterministic (under the default `training` sampling they would be sampled at
    temperature 1, and an early EOS would shorten one now and then)."""
    from launcher.evaluate import run_eval

    dataset = DatasetConfig(path=ROOT / "examples/math/data/test.jsonl", limit=3)
    driver = DriverConfig.model_validate(
        {
            "reward": "math",
            "eval": {
                "datasets": [dataset],
                "n_samples": 2,
                "k": [1, 2],
                "max_tokens": 6,
                "out_dir": tmp_path / "eval",
            },
        }
    )
    with gateway_factory(
        tmp_path, tiny_model_dir, [engine_url], "gateway.sampling.mode=client"
    ) as gateway:
        (row,) = run_eval(driver, gateway.config, gateway=gateway.url, api_key="sk-test-admin")
        assert row["num_questions"] == 3 and row["greedy_length"] == 6.0
        assert set(row) >= {"greedy_acc", "sample_pass@1", "pass@1", "pass@2"}
        assert httpx.get(f"{gateway.url}/rl/sessions", headers=ADMIN).json()["data"] == []
    assert (tmp_path / "eval" / "results.csv").exists()
