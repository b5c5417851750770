"""Swapping one policy's adapter leaves the other policies alone (issue 29's done-when),
on the real local engine behind the real gateway: policy `verifier` streams steadily
while policy `solver`'s adapter is published and swapped several times, with `solver`
traffic in flight too. Every request succeeds; the gateway resubmitted exactly the
solver's requests that a swap cut (each resubmission is one more adapter version in
that completion's captured tokens) and no verifier request (the global pause of a
full-weights swap would have cut them too). A backend that comes back is re-synced to
every policy's adapter version, not only the default policy's."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from support.harness import ADMIN_KEY, run_gateway
from support.loopback import free_port

from areal_service.types import WeightVersionRecord
from engine.testing import start_engine_in_thread
from gateway.backends import SGLangClient
from gateway.routing import BackendPool

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
OVERRIDES = (
    "gateway.sessions.staleness_gate=false",
    "gateway.router.weight_poll_interval_s=0.02",
    "trainer.lora.rank=4",
    "trainer.lora.alpha=8",
    "policies=[{name: solver}, {name: verifier}]",
)


def write_adapter(model_dir: Path, out: Path, seed: int, rank: int = 4) -> Path:
    """A trained-looking adapter (random nonzero A and B) in PEFT's layout."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from areal_service.config import LoRAConfig
    from trainer.lora import peft_config

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        peft_config(LoRAConfig(rank=rank, alpha=2.0 * rank)),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(out)
    return out


class Streamer(threading.Thread):
    """Streams chat completions of one key back to back until `stop` is set; records
    each request's (start, end, completion id) and every failure."""

    def __init__(self, gw: Any, key: str, stop: threading.Event, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0, timeout=60)
        self.stop, self.max_tokens = stop, max_tokens
        self.done: list[tuple[float, float, str]] = []
        self.failures: list[BaseException] = []

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                stream = self.client.chat.completions.create(
                    model="my-agent",
                    messages=[{"role": "user", "content": f"go {len(self.done)}"}],
                    max_tokens=self.max_tokens,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                ids, tokens = set(), 0
                for chunk in stream:
                    ids.add(chunk.id)
                    if chunk.choices:  # the tiny model's random tokens may open a
                        delta = chunk.choices[0].delta  # reasoning block or a tool call
                        extra = delta.model_extra or {}
                        tokens += bool(
                            delta.content or delta.tool_calls or extra.get("reasoning_content")
                        )
                assert len(ids) == 1 and tokens > 0, (ids, tokens)
                self.done.append((t0, time.monotonic(), ids.pop()))
            except BaseException as exc:  # counted; the test asserts there are none
                self.failures.append(exc)


def _versions(store: Any, completion_id: str) -> list[int]:
    deadline = time.monotonic() + 30
    while (c := store.get_completion(completion_id)) is None:  # group-commit writer
        assert time.monotonic() < deadline, completion_id
        time.sleep(0.02)
    return list(c.output_versions)


def _publish(gw: Any, path: Path, version: int, policy: str) -> None:
    gw.state.store.add_weight_version(
        WeightVersionRecord(version=version, path=str(path.resolve()), policy=policy)
    )
    deadline = time.monotonic() + 60
    while (
        gw.state.live_version if policy == "default" else gw.state.policy_versions.get(policy, 0)
    ) < version:
        assert time.monotonic() < deadline, f"{policy} v{version} never went live"
        time.sleep(0.005)


@pytest.mark.parametrize("swapped", ["solver", "default"])
def test_one_policys_swaps_leave_the_others_traffic_alone(
    tmp_path: Path, tiny_model_dir: Path, swapped: str
) -> None:
    """`swapped`: the policy whose adapter is swapped; the default policy's adapter
    swaps alone too once other policies are declared."""
    adapters = [write_adapter(tiny_model_dir, tmp_path / f"solver-v{v}", v) for v in (1, 2)]
    swaps = 6
    with (
        start_engine_in_thread(tiny_model_dir) as engine,
        run_gateway(tmp_path, tiny_model_dir, [engine], *OVERRIDES) as gw,
    ):
        keys = {
            p: httpx.post(
                f"{gw.url}/admin/keys", json={"policy": p}, headers=ADMIN, timeout=30
            ).json()["api_key"]
            for p in ("solver", "verifier", "default")
        }
        registry = gw.state.metrics.registry

        def resubmitted() -> float:
            return registry.get_sample_value("areal_resubmissions_total") or 0.0

        stop = threading.Event()
        verifiers = [Streamer(gw, keys["verifier"], stop, 24) for _ in range(2)]
        solver = Streamer(gw, keys[swapped], stop, 48)
        for s in (*verifiers, solver):
            s.start()
        before = resubmitted()
        swapped_at = []
        for v in range(1, swaps + 1):
            time.sleep(0.4)  # the streams are mid-request at each swap
            _publish(gw, adapters[v % 2], v, swapped)
            swapped_at.append(time.monotonic())
        time.sleep(0.4)
        stop.set()
        for s in (*verifiers, solver):
            s.join(timeout=60)
            assert not s.is_alive()
        resubmissions = resubmitted() - before

        done = [d for s in verifiers for d in s.done]
        assert not [f for s in (*verifiers, solver) for f in s.failures]
        # Each swap landed while verifier requests were streaming: a global pause would
        # have cut (and resubmitted) them.
        cut = [t for t in swapped_at if any(a < t < b for a, b, _ in done)]
        assert len(cut) == swaps, (len(cut), swaps)
        store = gw.state.store
        assert all(set(_versions(store, cid)) == {0} for _, _, cid in done)
        # Every resubmission was a solver request that a swap cut: one more version in
        # its tokens each time (a round never spans a swap), versions rising.
        solver_rounds = 0
        for _, _, cid in solver.done:
            versions = _versions(store, cid)
            runs = [v for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]]
            assert runs == sorted(runs), versions
            solver_rounds += len(runs) - 1
        assert resubmissions == solver_rounds >= 1, (resubmissions, solver_rounds)
        latencies = sorted(b - a for a, b, _ in done)
        print(
            f"\nverifier: {len(done)} streams, 0 failed, 0 resubmitted across {swaps} solver "
            f"swaps; p50 {statistics.median(latencies):.3f}s; {swapped}: {len(solver.done)} "
            f"streams, {solver_rounds} resubmitted"
        )


async def test_a_returning_backend_gets_every_policys_adapter(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """An engine that restarted (its adapters gone) is re-synced to each named policy's
    last swapped adapter before it is back in rotation; one that kept them is not
    loaded again."""
    solver = write_adapter(tiny_model_dir, tmp_path / "solver-v3", 3)
    verifier = write_adapter(tiny_model_dir, tmp_path / "verifier-v1", 4)
    port = free_port()
    pool = BackendPool(
        [f"http://127.0.0.1:{port}"], client_factory=lambda url: SGLangClient(url, timeout_s=60)
    )
    try:
        with start_engine_in_thread(tiny_model_dir, port=port):
            timings = await pool.swap_weights(str(solver), 3, "solver")
            assert [t.pause_s for t in timings.values()] == [0.0]  # no pause was sent
            await pool.swap_weights(str(verifier), 1, "verifier")
            info = await pool.backends[0].client.model_info()
            assert info.adapter_versions == {"solver": "3", "verifier": "1"}
        pool.mark_down(pool.backends[0], "restarting")
        with start_engine_in_thread(tiny_model_dir, port=port):
            client = pool.backends[0].client
            assert (await client.model_info()).adapter_versions == {}
            pool.backends[0].next_probe_at = 0.0
            await pool.check_health(only_down=True)
            assert pool.status()[0].healthy, pool.status()[0].last_error
            info = await client.model_info()
            assert info.adapter_versions == {"solver": "3", "verifier": "1"}
            assert info.weight_version == "default"  # no default-policy swap happened
    finally:
        await pool.aclose()
