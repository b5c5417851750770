"""A named policy with its own full weights (`policies[].weights: full`), end to end on
the real local engine (issue 29): two engines, one for the main pool (the default policy
and the LoRA policy `solver`) and one for the full-weight policy `critic`. A key bound to
`critic` is served by the critic's engine only; the critic's trainer (`trainer.policy`,
no LoRA) fine-tunes every weight, trains a step and publishes a full checkpoint under
`weights/critic/`; the gateway swaps it onto the critic's engine only (the main engine
keeps its version and is never paused); the critic's served logprobs equal its trainer's
forward on the published checkpoint, while the other policies still serve the base
model; a critic engine that restarts is re-synced to the critic's live version before
it serves again."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from safetensors.torch import load_file
from support.harness import ADMIN_KEY, run_gateway
from support.policy_run import policy_episodes
from support.trainer_run import train_in_thread
from support.weight_checks import served_sequence, trainer_logprobs

from areal_service.config import load_config
from areal_service.store import TrajectoryStore
from areal_service.types import TrainSequence
from engine.testing import start_engine_in_thread

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def _overrides(critic_url: str) -> tuple[str, ...]:
    return (
        "trainer.group_size=2",
        "trainer.batch_groups=2",
        "trainer.lr=1e-2",
        "trainer.total_steps=1",
        "gateway.sessions.staleness_gate=false",
        "gateway.router.health_interval_s=0.5",
        "trainer.lora.rank=8",
        f"policies=[{{name: solver}}, {{name: critic, weights: full, backends: [{critic_url}]}}]",
    )


def _served(gw: Any, key: str, *, stream: bool = False) -> list[TrainSequence]:
    """Two completions under `key` (the second streamed when `stream`), as stored."""
    client = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)
    ids = []
    for t in (1.0, 0.7):
        messages = [{"role": "user", "content": f"hi {t}"}]
        if stream and t == 0.7:
            chunks = client.chat.completions.create(
                model="my-agent", messages=messages, max_tokens=10, temperature=t, stream=True
            )
            ids.append({c.id for c in chunks}.pop())
        else:
            ids.append(
                client.chat.completions.create(
                    model="my-agent", messages=messages, max_tokens=10, temperature=t
                ).id
            )
    return [served_sequence(gw.state.store, i) for i in ids]


def _backends(gw: Any, sequences: list[TrainSequence]) -> set[str]:
    return {gw.state.store.get_completion(s.completion_ids[0]).backend for s in sequences}


def _versions(sequences: list[TrainSequence]) -> set[int]:
    return {v for s in sequences for v in s.versions if v >= 0}


def _max_gap(model_dir: Path, sequences: list[TrainSequence], adapter: Path | None = None) -> float:
    trainer, engine = trainer_logprobs(model_dir, sequences, adapter=adapter)
    assert engine.numel() > 2
    return float((trainer - engine).abs().max())


def _count_pauses(client: Any) -> list[str]:
    """The pause modes `client` is asked for from now on (it still pauses: this only
    records the call)."""
    calls: list[str] = []
    pause = client.pause_generation

    async def counted(mode: str = "abort") -> Any:
        calls.append(mode)
        return await pause(mode)

    client.pause_generation = counted
    return calls


def _weight_version(url: str) -> str:
    return str(httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"])


def _wait(condition: Any, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_full_weight_policy_is_served_trained_and_swapped_on_its_own_pool(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    # The critic's engine in a stack of its own: the test stops and restarts it.
    with start_engine_in_thread(tiny_model_dir) as main_url, ExitStack() as critic:
        critic_url = critic.enter_context(start_engine_in_thread(tiny_model_dir))
        with run_gateway(tmp_path, tiny_model_dir, [main_url], *_overrides(critic_url)) as gw:
            _scenario(gw, tmp_path, tiny_model_dir, main_url, critic, critic_url)


def _scenario(
    gw: Any, tmp_path: Path, model_dir: Path, main_url: str, critic: ExitStack, critic_url: str
) -> None:
    """The test's body (`critic`: the critic engine's stack, restarted once here)."""
    store = gw.state.store
    assert set(gw.state.policy_pools) == {"critic"}
    keys = {
        p: httpx.post(f"{gw.url}/admin/keys", json={"policy": p}, headers=ADMIN, timeout=30).json()[
            "api_key"
        ]
        for p in ("critic", "solver", "default")
    }
    # Routing: the critic's key is served by the critic's engine, the others by the main one.
    before = {p: _served(gw, k, stream=True) for p, k in keys.items()}
    assert _backends(gw, before["critic"]) == {critic_url}
    assert _backends(gw, before["solver"]) == {main_url} == _backends(gw, before["default"])
    assert {store.get_completion(s.completion_ids[0]).model for s in before["critic"]} == {"critic"}

    pauses = {
        "main": _count_pauses(gw.state.backends.backends[0].client),
        "critic": _count_pauses(gw.state.policy_pools["critic"].backends[0].client),
    }
    policy_episodes(gw, "critic", 2)
    policy_episodes(gw, "solver", 1)  # not the critic's: its trainer must leave them
    config = gw.config.model_copy(
        update={"trainer": gw.config.trainer.model_copy(update={"policy": "critic"})}
    )
    train_in_thread(config, timeout_s=240)
    assert [(s.step, s.version) for s in store.list_train_steps(policy="critic")] == [(1, 1)]
    assert store.list_train_steps() == [] == store.list_train_steps(policy="solver")

    # A full checkpoint (every weight trained), not an adapter.
    critic_v1 = tmp_path / "weights" / "critic" / "v1"
    assert (critic_v1 / "config.json").is_file()
    assert not (critic_v1 / "adapter_config.json").exists()
    published = {k: v for f in critic_v1.glob("*.safetensors") for k, v in load_file(f).items()}
    base = {k: v for f in model_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    moved = [k for k in base if k in published and not published[k].equal(base[k])]
    assert len(moved) >= len(base) // 2, f"only {len(moved)} of {len(base)} tensors trained"

    # The swap: the critic's pool only, the critic's version only.
    def swapped() -> bool:  # the syncer records the swap on the row last
        row = store.latest_weight_version("critic")
        return row is not None and "swap_mode" in row.metadata

    _wait(swapped, "critic v1 never went live")
    row = store.latest_weight_version("critic")
    assert row is not None and row.version == 1 and gw.state.policy_versions["critic"] == 1
    assert set(row.metadata["swap"]) == {critic_url}
    assert _weight_version(critic_url) == "1"
    assert _weight_version(main_url) == "default"  # never swapped (nor paused by a swap)
    assert gw.state.live_version == 0 and "solver" not in gw.state.policy_versions
    assert gw.state.policy_pools["critic"].target == (row.path, 1)
    assert gw.state.backends.target is None

    after = {p: _served(gw, k, stream=True) for p, k in keys.items()}
    assert _versions(after["critic"]) == {1}
    assert _versions(after["solver"]) == {0} == _versions(after["default"])
    assert _backends(gw, after["critic"]) == {critic_url}
    gaps = {
        "critic on v1": _max_gap(critic_v1, after["critic"]),
        "critic on the base": _max_gap(model_dir, after["critic"]),
        "solver on the base": _max_gap(model_dir, after["solver"]),
        "default on the base": _max_gap(model_dir, after["default"]),
    }
    print("max |served - trainer| logprob:", {k: f"{v:.2e}" for k, v in gaps.items()})
    assert gaps["critic on v1"] <= 1e-4
    assert gaps["critic on the base"] > 1e-3  # the training moved it
    assert gaps["solver on the base"] <= 1e-4 and gaps["default on the base"] <= 1e-4

    # A restarted critic trainer resumes from its own checkpoint: step 2 publishes v2.
    policy_episodes(gw, "critic", 2)
    resumed = config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"total_steps": 2})}
    )
    train_in_thread(resumed, timeout_s=240)
    assert [(s.step, s.version) for s in store.list_train_steps(policy="critic")] == [
        (1, 1),
        (2, 2),
    ]
    critic_v2 = tmp_path / "weights" / "critic" / "v2"
    _wait(lambda: _weight_version(critic_url) == "2", "critic v2 never reached its engine")
    _wait(lambda: gw.state.policy_pools["critic"].target == (str(critic_v2.resolve()), 2), "v2")
    assert _weight_version(main_url) == "default" and gw.state.backends.target is None
    assert store.latest_weight_version() is None  # the default policy published nothing
    v2 = _served(gw, keys["critic"])
    assert _versions(v2) == {2} and _max_gap(critic_v2, v2) <= 1e-4
    # Each swap paused the critic's engine; the main engine's traffic was never paused.
    assert (len(pauses["main"]), len(pauses["critic"])) == (0, 2)
    views = {
        v["name"]: v
        for v in httpx.get(f"{gw.url}/admin/policies", headers=ADMIN, timeout=30).json()["data"]
    }
    assert (views["critic"]["weights"], views["critic"]["backends"]) == ("full", [critic_url])
    assert (views["critic"]["live_version"], views["critic"]["lora_rank"]) == (2, None)
    assert (views["solver"]["weights"], views["solver"]["backends"]) == ("lora", [])
    swaps = gw.state.metrics.registry.get_sample_value(
        "areal_policy_swap_seconds_count", {"policy": "critic", "phase": "swap"}
    )
    assert swaps == 2  # both of the critic's versions, swapped on its own pool

    # The critic's engine restarts (on the base weights): re-synced to v2 before serving.
    critic.close()
    pool = gw.state.policy_pools["critic"]
    _wait(lambda: not pool.backends[0].healthy, "the stopped critic engine stayed in rotation")
    # Meanwhile the critic's requests get a 503 in the OpenAI error shape, and the other
    # policies are served as before.
    down = openai.OpenAI(base_url=gw.v1, api_key=keys["critic"], max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        down.chat.completions.create(
            model="my-agent", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert refused.value.status_code == 503, refused.value
    assert "unavailable" in refused.value.message
    assert _backends(gw, _served(gw, keys["solver"])) == {main_url}
    ready = httpx.get(f"{gw.url}/health/readiness", timeout=10)
    assert ready.status_code == 200, ready.text  # the main pool serves: still ready
    assert ready.json()["policy_backends"] == {
        "critic": [{"url": critic_url, "healthy": False, "in_flight": 0}]
    }
    port = int(critic_url.rsplit(":", 1)[1])
    assert critic.enter_context(start_engine_in_thread(model_dir, port=port)) == critic_url
    _wait(lambda: pool.backends[0].healthy, "the restarted critic engine never came back")
    assert _weight_version(critic_url) == "2"
    again = _served(gw, keys["critic"])
    assert _versions(again) == {2} and _max_gap(critic_v2, again) <= 1e-4
    assert _weight_version(main_url) == "default"


def test_the_local_stack_starts_an_engine_for_a_full_weight_policy(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`demo`/`train`'s process tree (`local_stack`) starts the critic's engine beside the
    main one, the gateway routes the critic's key to it, and all of them stop after."""
    from support.loopback import free_port

    from launcher.stack import local_stack

    critic_port = free_port()
    config = load_config(
        overrides=[
            f"data_dir={tmp_path / 'data'}",
            f"engine.model={tiny_model_dir}",
            f"engine.port={free_port()}",
            f"gateway.port={free_port()}",
            f"gateway.auth.admin_key={ADMIN_KEY}",
            "engine.torch_threads=1",
            f"policies=[{{name: critic, weights: full, port: {critic_port}}}]",
        ]
    )
    critic_url = f"http://127.0.0.1:{critic_port}"
    with local_stack(config, tmp_path / "run", trainer=False) as stack:
        assert [c.name for c in stack.children] == ["engine", "engine-critic", "gateway"]
        made = httpx.post(
            f"{stack.gateway_url}/admin/keys", json={"policy": "critic"}, headers=ADMIN, timeout=30
        )
        assert made.status_code == 201, made.text
        client = openai.OpenAI(
            base_url=f"{stack.gateway_url}/v1", api_key=made.json()["api_key"], max_retries=0
        )
        reply = client.chat.completions.create(
            model="my-agent", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        children = list(stack.children)
    assert all(c.proc.poll() is not None for c in children)
    store = TrajectoryStore.open(config.database_url(), config.store)
    try:
        served = store.get_completion(reply.id)
        assert (served.model, served.backend) == ("critic", critic_url)
    finally:
        store.close()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{critic_url}/health", timeout=2)
