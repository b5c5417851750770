"""Two policies on one base model, end to end on the real local engine (issue 29,
second slice): two keys bound to two policies, episodes under each, one trainer process
per policy (`trainer.policy`) trains a step and publishes its adapter under
`weights/<policy>/`, the gateway swaps only that policy's adapter, and each policy's
requests keep being served under its own adapter: the engine's logprobs equal the
trainer's PEFT forward on that policy's published adapter (the other policy's tokens
stay at its own version, on its own weights)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
from support.harness import ADMIN_KEY, run_gateway
from support.policy_run import policy_episodes
from support.weight_checks import served_sequence, trainer_logprobs

from areal_service.types import TrainSequence
from engine.testing import start_engine_in_thread
from trainer.train import main

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
OVERRIDES = (
    "trainer.group_size=2",
    "trainer.batch_groups=2",
    "trainer.lr=1e-2",
    "trainer.total_steps=1",
    "gateway.sessions.staleness_gate=false",
    "trainer.lora.rank=8",
    "trainer.lora.alpha=16",
    "policies=[{name: solver, model_names: [solver-model]}, {name: verifier}]",
)


def _train(gw: Any, policy: str) -> None:
    """One trainer process's run for `policy` (a thread here; `trainer --policy`)."""
    config = gw.config.model_copy(
        update={"trainer": gw.config.trainer.model_copy(update={"policy": policy})}
    )
    failure: list[BaseException] = []

    def run() -> None:
        try:
            main(config)
        except BaseException as exc:  # surfaced by the assert below
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"trainer-{policy}")
    thread.start()
    thread.join(timeout=240)
    assert not thread.is_alive(), f"the {policy} trainer did not finish its step"
    assert not failure, failure


def _wait_swapped(gw: Any, policy: str, version: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while gw.state.policy_versions.get(policy, 0) < version:
        assert time.monotonic() < deadline, f"{policy} v{version} never went live"
        time.sleep(0.05)


def _served(gw: Any, key: str, model: str = "my-agent") -> list[TrainSequence]:
    client = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)
    replies = [
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"hi {t}"}],
            max_tokens=10,
            temperature=t,
        )
        for t in (1.0, 0.7)
    ]
    return [served_sequence(gw.state.store, r.id) for r in replies]


def _versions(sequences: list[TrainSequence]) -> set[int]:
    return {v for s in sequences for v in s.versions if v >= 0}


def _max_gap(model_dir: Path, sequences: list[TrainSequence], adapter: Path | None) -> float:
    trainer, engine = trainer_logprobs(model_dir, sequences, adapter=adapter)
    assert engine.numel() > 2
    return float((trainer - engine).abs().max())


def test_two_policies_train_and_swap_apart(tmp_path: Path, tiny_model_dir: Path) -> None:
    with (
        start_engine_in_thread(tiny_model_dir) as engine,
        run_gateway(tmp_path, tiny_model_dir, [engine], *OVERRIDES) as gw,
    ):
        store = gw.state.store
        keys = {
            p: httpx.post(
                f"{gw.url}/admin/keys", json={"policy": p}, headers=ADMIN, timeout=30
            ).json()["api_key"]
            for p in ("solver", "verifier")
        }
        policy_episodes(gw, "solver", 2)
        policy_episodes(gw, "verifier", 2)

        _train(gw, "solver")  # trains only the solver's episodes
        assert [(s.step, s.version) for s in store.list_train_steps(policy="solver")] == [(1, 1)]
        assert store.list_train_steps() == [] == store.list_train_steps(policy="verifier")
        assert {
            store.get_session(s.id).status
            for s in store.list_sessions(limit=100)
            if s.policy == "verifier"
        } == {"ended"}
        solver_v1 = tmp_path / "weights" / "solver" / "v1"
        assert store.latest_weight_version("solver").path == str(solver_v1.resolve())
        _wait_swapped(gw, "solver", 1)
        assert "verifier" not in gw.state.policy_versions and gw.state.live_version == 0

        solver_seqs, verifier_seqs = _served(gw, keys["solver"]), _served(gw, keys["verifier"])
        assert _versions(solver_seqs) == {1} and _versions(verifier_seqs) == {0}
        assert _max_gap(tiny_model_dir, solver_seqs, solver_v1) <= 1e-4
        assert _max_gap(tiny_model_dir, verifier_seqs, None) <= 1e-4  # still the base
        assert _max_gap(tiny_model_dir, solver_seqs, None) > 1e-3  # the adapter moved it

        # A bound key is served by its own policy whatever model name it sends, another
        # policy's alias included (issue 37, N2).
        aliased = _served(gw, keys["verifier"], model="solver-model")
        assert _versions(aliased) == {0}
        assert {store.get_completion(s.completion_ids[0]).model for s in aliased} == {"verifier"}

        _train(gw, "verifier")
        verifier_v1 = tmp_path / "weights" / "verifier" / "v1"
        _wait_swapped(gw, "verifier", 1)
        assert gw.state.policy_versions == {"solver": 1, "verifier": 1}
        solver_seqs, verifier_seqs = _served(gw, keys["solver"]), _served(gw, keys["verifier"])
        assert _versions(solver_seqs) == {1} and _versions(verifier_seqs) == {1}
        assert _max_gap(tiny_model_dir, verifier_seqs, verifier_v1) <= 1e-4
        # The verifier's swap left the solver on its own adapter.
        assert _max_gap(tiny_model_dir, solver_seqs, solver_v1) <= 1e-4
        assert _max_gap(tiny_model_dir, solver_seqs, verifier_v1) > 1e-3
