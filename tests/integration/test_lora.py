"""LoRA RL on the local engine, end to end with real parts: episodes through the real
gateway and engine, the trainer (`trainer.lora`, PEFT under FSDP2 on CPU) trains two
steps and publishes adapters, the gateway's syncer swaps them into the engine in place,
and the engine's logprobs then equal the trainer's PEFT forward on the published adapter
(the tolerance the full-weights loop test holds)."""

from __future__ import annotations

import time

import httpx
import openai
from safetensors.torch import load_file
from support.harness import ADMIN_KEY, run_gateway
from support.trainer_run import train_in_thread
from support.weight_checks import served_sequence, trainer_logprobs

from areal_service.lora_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from engine.testing import start_engine_in_thread

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def _run_groups(gw, n_groups: int) -> None:
    http = httpx.Client(base_url=gw.url, timeout=60)
    for g in range(n_groups):
        started = http.post("/rl/sessions", json={"group_size": 2}, headers=ADMIN)
        assert started.status_code == 201, started.text
        for j, s in enumerate(started.json()["sessions"]):
            client = openai.OpenAI(base_url=gw.v1, api_key=s["api_key"], max_retries=0)
            client.chat.completions.create(
                model="areal-policy",
                max_tokens=8,
                messages=[{"role": "user", "content": f"count to {g}"}],
            )
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


def test_lora_trainer_publishes_adapters_and_engine_serves_them(tmp_path, tiny_model_dir):
    overrides = (
        "trainer.group_size=2",
        "trainer.batch_groups=2",
        "trainer.lr=1e-2",
        "trainer.total_steps=2",
        "gateway.sessions.staleness_gate=false",
        "trainer.lora.rank=8",
        "trainer.lora.alpha=16",
    )
    with (
        start_engine_in_thread(tiny_model_dir) as engine,
        run_gateway(tmp_path, tiny_model_dir, [engine], *overrides) as gw,
    ):
        _run_groups(gw, n_groups=4)
        train_in_thread(gw.config, timeout_s=180)
        store = gw.state.store
        assert [(s.step, s.version) for s in store.list_train_steps()] == [(1, 1), (2, 2)]
        v2 = tmp_path / "weights" / "v2"
        assert sorted(p.name for p in v2.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
        assert any(
            t.abs().max() > 0 for k, t in load_file(v2 / ADAPTER_WEIGHTS).items() if "lora_B" in k
        )

        assert _wait_version(engine, "2"), "the engine never served v2"
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
        assert store.get_weight_version(2).metadata["swap_mode"] == "disk"

    trainer_v2, engine_v2 = trainer_logprobs(tiny_model_dir, served, adapter=v2)
    assert engine_v2.numel() == sum(r.usage.completion_tokens for r in replies) > 2
    assert float((trainer_v2 - engine_v2).abs().max()) <= 1e-4
    base, _ = trainer_logprobs(tiny_model_dir, served)  # the adapter changed the policy
    assert float((base - engine_v2).abs().max()) > 1e-3


def _wait_version(engine: str, version: str, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(f"{engine}/model_info").json()["weight_version"] == version:
            return True
        time.sleep(0.05)
    return False
