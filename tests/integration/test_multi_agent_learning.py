"""Both roles of a multi-agent episode learn: SmolLM2-135M-Instruct with two rank-8
LoRA adapters (policies `solver` and `reviewer`, `examples/multi_agent/`), one trainer
process per policy, the gateway and the engine as child processes, the example's agent
driving episodes. The solver answers single-digit additions (the episode's reward: its
correctness); the reviewer is shown the solver's answer and writes the final answer (its
role reward: a correct final answer). Prints both roles' held-out greedy accuracy before
and after; asserts each rose. The reviewer is scored on one right and one wrong (off by
1 or 2) proposal per held-out question, so a reviewer that copies every proposal scores
0.5, and it must also correct more of the wrong ones than before; its accuracy on the
untrained solver's own sampled answers, and how often it copied a wrong proposal, are
printed beside it.

Slow (many minutes on 2 cores) and needs the SmolLM2 wheel (downloaded, or from
AREAL_TEST_WHEEL_CACHE); the `vllm` leg needs vLLM (AREAL_TEST_VLLM_PYTHON)."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.loopback import free_port

from areal_service.config import ServiceConfig, load_config, with_admin_key
from areal_service.store import TrajectoryStore
from engine.pretrained import make_registry_model
from examples.multi_agent.agent import REVIEWER_MODEL, SOLVER_MODEL, MultiAgent, split
from launcher.processes import cli_argv
from launcher.stack import Stack, local_stack, share_cpus

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 16
MINUTES = 40.0
WORKERS = 4
REVIEWER_LR = 4e-4
ROLES = ("solver", "reviewer")
ROLE_ARGS = {"reviewer": ("--set", f"trainer.lr={REVIEWER_LR}")}
"""Per-role trainer settings: each role's trainer is its own process with its own
config. The reviewer must unlearn trusting the proposal as well as learn the sum, so it
gets twice the solver's rate."""


def _config(tmp_path: Path, model: Path, backend: list[str]) -> ServiceConfig:
    config = load_config(
        ROOT / "examples" / "multi_agent" / "config.yaml",
        overrides=[
            f"data_dir={tmp_path / 'data'}",
            f"engine.model={model}",
            f"engine.port={free_port()}",
            f"gateway.port={free_port()}",
            f"trainer.total_steps={STEPS}",
            "trainer.checkpoint_every=1000",
            *backend,
        ],
    )
    config = with_admin_key(config)
    tree = config.model_dump(mode="python")
    tree["gateway"]["auth"]["admin_key"] = config.gateway.auth.admin_key.get_secret_value()
    share_cpus(tree, trainer_procs=2)
    return ServiceConfig.model_validate(tree)


async def _latest(http: httpx.AsyncClient, admin: str) -> dict[str, int]:
    """Each role's newest published version."""
    r = await http.get("/admin/policies", headers={"authorization": f"Bearer {admin}"})
    r.raise_for_status()
    return {p["name"]: p["latest_version"] or 0 for p in r.json()["data"] if p["name"] in ROLES}


async def _served_version(agent: MultiAgent, config: ServiceConfig, model: str) -> int:
    """The version of `model`'s policy that served a fresh greedy request (its record)."""
    reply = await agent.client.chat.completions.create(
        model=model, max_tokens=2, temperature=0.0, messages=[{"role": "user", "content": "1"}]
    )
    store = TrajectoryStore.open(config.database_url(), config.store)
    try:
        record = store.get_completion(reply.id)
    finally:
        store.close()
    assert record is not None
    return min(record.output_versions, default=-1)


async def _drive(config: ServiceConfig, stack: Stack) -> dict[str, Any]:
    train, held_out = split()
    admin = config.gateway.auth.admin_key.get_secret_value()
    agent = MultiAgent(stack.gateway_url, admin)
    batch = config.trainer.batch_groups
    try:
        proposals = await agent.solver_proposals(held_out)
        before = await agent.evaluate(held_out, proposals)
        print(f"before: {before}", flush=True)
        cfg_path = str(stack.run_dir / "config.yaml")
        trainers = [
            stack.start(
                f"trainer-{p}",
                cli_argv("trainer", "--config", cfg_path, "--policy", p, *ROLE_ARGS.get(p, ())),
            )
            for p in ROLES
        ]
        started_at = time.monotonic()
        versions = {p: 0 for p in ROLES}
        started = 0
        rewards: dict[str, list[float]] = {p: [] for p in ROLES}

        async def worker(offset: int) -> None:
            nonlocal started
            i = offset
            while True:
                # Stay at most 2 steps ahead of the slower trainer: older episodes would
                # be dropped as stale (max_staleness 2) and only cost time.
                while started >= (min(versions.values()) + 2) * batch:
                    await asyncio.sleep(0.5)
                started += 1
                outcomes = await agent.group(train[i % len(train)], config.trainer.group_size)
                rewards["solver"] += [o.solver for o in outcomes]
                rewards["reviewer"] += [o.reviewer for o in outcomes]
                i += WORKERS

        workers = [asyncio.create_task(worker(k)) for k in range(WORKERS)]
        deadline = started_at + MINUTES * 60
        report = time.monotonic() + 30
        while any(t.proc.poll() is None for t in trainers) and time.monotonic() < deadline:
            await asyncio.sleep(2)
            versions = await _latest(agent.http, admin)
            for w in workers:
                if w.done() and w.exception() is not None:
                    raise w.exception()  # type: ignore[misc]
            if time.monotonic() >= report:
                report += 30
                recent = {p: statistics.fmean(r[-64:]) if r else 0.0 for p, r in rewards.items()}
                print(
                    f"[{time.monotonic() - started_at:5.0f}s] versions {versions} "
                    f"groups {started} recent reward {recent}",
                    flush=True,
                )
        train_wall = time.monotonic() - started_at
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        assert all(t.proc.poll() == 0 for t in trainers), "a trainer did not finish its steps"
        for model in (SOLVER_MODEL, REVIEWER_MODEL):  # the final adapters are live
            for _ in range(300):
                if await _served_version(agent, config, model) >= STEPS:
                    break
                await asyncio.sleep(0.2)
            else:
                raise AssertionError(f"{model}: v{STEPS} never went live")
        after = await agent.evaluate(held_out, proposals)
        return {
            "before": before,
            "after": after,
            "train_wall_s": train_wall,
            "groups": started,
            "first_rewards": {p: statistics.fmean(r[:64]) for p, r in rewards.items()},
            "last_rewards": {p: statistics.fmean(r[-64:]) for p, r in rewards.items()},
        }
    finally:
        await agent.aclose()


@pytest.mark.parametrize("engine", ["local", "vllm"])
def test_solver_and_reviewer_both_learn(
    tmp_path: Path, engine: str, request: pytest.FixtureRequest
) -> None:
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
    config = _config(tmp_path, model, backend)
    with local_stack(config, config.data_dir / "run", trainer=False) as stack:
        summary = asyncio.run(_drive(config, stack))
    before, after = summary["before"], summary["after"]
    print(f"\nmulti-agent on {engine}, {STEPS} steps per role, {summary['train_wall_s']:.0f} s")
    print(f"{'held-out greedy accuracy':<40} {'before (v0)':>12} {f'after (v{STEPS})':>12}")
    print(
        f"{'solver: single-digit addition':<40} {before['solver']:>12.3f} {after['solver']:>12.3f}"
    )
    rows = [
        ("reviewer: right vs off-by-1-2 proposals", "near_miss"),
        ("  on the wrong ones", "near_miss_wrong"),
        ("  on the right ones", "near_miss_right"),
        ("  wrong ones copied", "near_miss_copied_wrong"),
        ("reviewer: the solver's sampled answers", "proposals"),
        ("  wrong ones copied", "proposals_copied_wrong"),
    ]
    for label, name in rows:
        print(f"{label:<40} {before[name]:>12.3f} {after[name]:>12.3f}")
    print(f"(the solver's sampled answers reviewed: {before['proposals_right_share']:.0%} right)")
    print(
        f"training reward, first/last 64 episodes: solver "
        f"{summary['first_rewards']['solver']:.3f} -> {summary['last_rewards']['solver']:.3f}, "
        f"reviewer {summary['first_rewards']['reviewer']:.3f} -> "
        f"{summary['last_rewards']['reviewer']:.3f} ({summary['groups']} groups)"
    )
    assert after["solver"] >= before["solver"] + 0.1, (before, after)
    # Half the proposals are wrong: copying scores 0.5, and more copying cannot pass the
    # second check.
    assert after["near_miss"] >= before["near_miss"] + 0.1, (before, after)
    assert after["near_miss_wrong"] > before["near_miss_wrong"], (before, after)
