"""Every example runs against the gateway in front of the tiny model, with its own model
name and no network: the plain `openai` agents, the LangChain tool loop, the Agents SDK
math agent, the online agent with its separate judge, and the curl walkthrough."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from support.loopback import free_port

from areal_service.datasets import DatasetConfig, load_samples

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = load_samples(DatasetConfig(path=ROOT / "examples/math/data/train.jsonl", limit=2))
ADMIN = {"authorization": "Bearer sk-test-admin"}


def _session(gateway) -> tuple[str, str]:
    r = httpx.post(f"{gateway.url}/rl/sessions", headers=ADMIN, json={"task_id": "t"})
    assert r.status_code == 201, r.text
    return r.json()["session_id"], r.json()["api_key"]


def _session_view(gateway, session_id: str) -> dict:
    return httpx.get(f"{gateway.url}/rl/sessions/{session_id}", headers=ADMIN).json()


def _run_in_sessions(gateway, agent, **options) -> list[tuple[float, dict]]:
    """Run `agent` once per sample, each in its own session; (reward, session view)."""
    out = []
    for sample in SAMPLES:
        sid, key = _session(gateway)
        reward = asyncio.run(agent(sample, gateway.v1, key, **options))
        out.append((reward, _session_view(gateway, sid)))
    return out


def test_openai_client_single_and_multi_turn(gateway):
    from examples.openai_client.agents import multi_turn, single_turn

    for agent, turns in ((single_turn, 1), (multi_turn, 2)):
        for reward, view in _run_in_sessions(gateway, agent, max_tokens=12):
            assert reward in (0.0, 1.0)
            assert len(view["completions"]) == turns, agent.__name__


def test_langchain_tool_loop(gateway):
    from examples.langchain.agent import solve

    for reward, view in _run_in_sessions(gateway, solve, max_tokens=12):
        assert reward in (0.0, 1.0) and 1 <= len(view["completions"]) <= 4


def test_agents_sdk_math_agent(gateway):
    from examples.math.agent import solve

    for reward, view in _run_in_sessions(gateway, solve, max_tokens=12):
        assert reward in (0.0, 1.0) and len(view["completions"]) >= 1


def test_online_agent_refreshes_its_key_and_the_judge_scores_every_episode(gateway, tmp_path):
    from examples.online.agent import run_agent
    from examples.online.judge import judge

    made = httpx.post(f"{gateway.url}/admin/keys", headers=ADMIN, json={"name": "online"})
    assert made.status_code == 201, made.text
    user_key = made.json()["api_key"]
    queue = tmp_path / "queue.jsonl"
    by_id = {s["id"]: s for s in SAMPLES}

    async def both() -> tuple[int, int]:
        return await asyncio.gather(
            run_agent(gateway.url, user_key, SAMPLES, queue, episodes=3, max_tokens=8),
            judge(gateway.url, "sk-test-admin", by_id, queue, stop_after=3, poll_s=0.05),
        )

    assert asyncio.run(both()) == [3, 3]
    sessions = [
        __import__("json").loads(line)["session_id"] for line in queue.read_text().splitlines()
    ]
    assert len(set(sessions)) == 3
    views = [_session_view(gateway, sid) for sid in sessions]
    assert [v["end_reason"] for v in views[:2]] == ["refresh", "refresh"]
    assert views[2]["status"] == "open"  # the key's current episode
    for view in views:
        assert len(view["completions"]) == 1
        assert [r["id"] for r in view["rewards"]] == [f"judge-{view['session_id']}"]
    # a restarted judge re-reads the queue: the same reward ids, nothing posted twice
    assert asyncio.run(judge(gateway.url, "sk-test-admin", by_id, queue, stop_after=3)) == 3
    assert all(len(_session_view(gateway, s)["rewards"]) == 1 for s in sessions)


@pytest.mark.skipif(not (shutil.which("curl") and shutil.which("jq")), reason="needs curl and jq")
def test_curl_walkthrough(gateway):
    out = subprocess.run(
        ["bash", str(ROOT / "examples/curl/walkthrough.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "BASE": gateway.url, "ADMIN": "sk-test-admin"},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("session sess_") and lines[1].startswith("reply: ")
    assert isinstance(json.loads(lines[1].removeprefix("reply: ")), str)  # one line, any text
    assert '"value":1' in lines[2]
    assert '"status":"ended"' in lines[3] and '"completions":1' in lines[3]
    assert lines[4] == '{"status":"ended","end_reason":"client","completions":1,"rewards":[1]}'
    audit = httpx.get(f"{gateway.url}/admin/episodes/audit", headers=ADMIN).json()
    assert audit["unaccounted"] == 0 and audit["states"]["ended"] == 1


@pytest.mark.slow
def test_online_example_trains_while_the_agent_runs(tmp_path):
    """The online example end to end: gateway, engine and trainer from
    `examples/online/online.yaml` as child processes; the agent keeps one virtual key,
    the judge scores from the queue; the trainer takes steps on the judged sessions while
    the agent keeps going."""

    from examples.online.agent import run_agent
    from examples.online.judge import judge
    from launcher.driver_config import load_driver_config
    from launcher.stack import local_stack

    _, config = load_driver_config(
        ROOT / "examples/online/online.yaml",
        [
            f"data_dir={tmp_path / 'data'}",
            f"engine.port={free_port()}",
            f"gateway.port={free_port()}",
            "gateway.sampling.default_max_tokens=8",
            "trainer.batch_groups=4",
            "gateway.auth.admin_key=sk-test-admin",
        ],
    )
    samples = load_samples(DatasetConfig(path=ROOT / "examples/math/data/train.jsonl", limit=8))
    queue = tmp_path / "queue.jsonl"
    with local_stack(config, tmp_path / "run", trainer=True) as stack:
        admin = {"authorization": f"Bearer {config.gateway.auth.admin_key.get_secret_value()}"}
        made = httpx.post(f"{stack.gateway_url}/admin/keys", headers=admin, json={"name": "online"})
        # One gateway process in front of the local CPU engine (the workers default).
        assert "x-areal-worker" not in made.headers
        assert made.status_code == 201, made.text
        key = made.json()["api_key"]

        async def scenario() -> int:
            judging = asyncio.create_task(
                judge(
                    stack.gateway_url,
                    config.gateway.auth.admin_key.get_secret_value(),
                    {s["id"]: s for s in samples},
                    queue,
                    poll_s=0.05,
                )
            )
            try:
                deadline = asyncio.get_running_loop().time() + 180
                version = 0
                while version < 2 and asyncio.get_running_loop().time() < deadline:
                    await run_agent(
                        stack.gateway_url, key, samples, queue, episodes=4, max_tokens=8
                    )
                    status = httpx.get(f"{stack.gateway_url}/admin/status", headers=admin)
                    version = status.json()["live_version"]
                return version
            finally:
                judging.cancel()

        assert asyncio.run(scenario()) >= 2  # two updates swapped in while it ran
        audit = httpx.get(f"{stack.gateway_url}/admin/episodes/audit", headers=admin).json()
        assert audit["unaccounted"] == 0 and audit["states"]["trained"] >= 8, audit
