"""Verified swaps on the real local engine (issue 39): every published version carries
the trainer's canary fingerprint; the gateway scores the canary after the swap and
refuses, and rolls back, a version whose engine does not reproduce it, while agents keep
being served: zero failed requests and no token ever labelled with a refused version."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
from support.canary import fingerprint_of, scale_one_tensor
from support.harness import ADMIN_KEY, Gateway, run_gateway

from areal_service.types import WeightVersionRecord
from engine.testing import make_weight_variant, start_engine_in_thread

CHAT = {"model": "areal-policy", "max_tokens": 24}


async def _traffic(gw, stop: asyncio.Event, failures: list[str], ids: list[str]) -> None:
    """Four agents chatting (half streaming) until `stop`; every failure is kept."""
    async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
        started = await http.post(
            "/rl/sessions",
            json={"group_size": 4},
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
        )
        keys = [s["api_key"] for s in started.json()["sessions"]]

        async def agent(key: str, stream: bool) -> None:
            headers = {"authorization": f"Bearer {key}"}
            body = {**CHAT, "messages": [{"role": "user", "content": "tell me a story"}]}
            while not stop.is_set():
                r = await http.post(
                    "/v1/chat/completions", json={**body, "stream": stream}, headers=headers
                )
                if r.status_code != 200 or (stream and "data: [DONE]" not in r.text):
                    failures.append(f"{r.status_code} {r.text[:200]}")
                    return
                if not stream:
                    ids.append(r.json()["id"])
                else:
                    ids.extend(
                        line.split('"id":"')[1].split('"')[0]
                        for line in r.text.splitlines()[:1]
                        if '"id":"' in line
                    )

        await asyncio.gather(*(agent(k, i % 2 == 0) for i, k in enumerate(keys)))


def _console(gw, path: str) -> str:
    """`path` of the console, signed in with the admin key."""
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        login = http.get("/console/login").text
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', login)
        assert csrf is not None
        http.post("/console/login", data={"csrf_token": csrf[1], "admin_key": ADMIN_KEY})
        page = http.get(path)
        assert page.status_code == 200, page.text[:300]
        return page.text


async def _settled(gw, version: int, timeout_s: float = 60) -> WeightVersionRecord:
    """The row of `version` once the gateway judged it (and, when it passed, recorded
    its swap: the verdict is written first)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        row = gw.state.store.get_weight_version(version)
        verdict = row.metadata.get("verify") if row is not None else None
        if verdict is not None and (verdict["refused"] or "live_at" in row.metadata):
            return row
        assert asyncio.get_running_loop().time() < deadline, f"v{version} never judged"
        await asyncio.sleep(0.05)


@contextlib.contextmanager
def _verified_gateway(tmp_path: Path, model_dir: Path) -> Iterator[tuple[str, Gateway]]:
    """A local engine and a gateway verifying every swap, polling fast."""
    with (
        start_engine_in_thread(model_dir) as engine,
        run_gateway(
            tmp_path / "gw",
            model_dir,
            [engine],
            "gateway.router.weight_poll_interval_s=0.02",
            "swap_verify.enabled=true",
        ) as gw,
    ):
        yield engine, gw


def _publish(gw, version: int, path: Path, canary: dict) -> None:
    gw.state.store.add_weight_version(
        WeightVersionRecord(version=version, path=str(path), metadata={"canary": canary})
    )


def test_bad_swaps_are_refused_and_rolled_back_under_load(tmp_path, tiny_model_dir):
    v1, v2, v3, v4 = (
        make_weight_variant(tiny_model_dir, tmp_path / f"v{i}", seed=200 + i) for i in range(1, 5)
    )
    fp1 = fingerprint_of(v1, tiny_model_dir, tiny_model_dir)
    fp2 = fingerprint_of(v2, tiny_model_dir, v1)
    scale_one_tensor(v2)  # (1) the files are corrupted after the fingerprint
    fp3 = fingerprint_of(v3, tiny_model_dir, v1)
    fp4 = fingerprint_of(v4, tiny_model_dir, v3)
    with _verified_gateway(tmp_path, tiny_model_dir) as (engine, gw):

        async def drive() -> tuple[list[str], list[str], dict[int, WeightVersionRecord]]:
            failures: list[str] = []
            ids: list[str] = []
            stop = asyncio.Event()
            traffic = asyncio.create_task(_traffic(gw, stop, failures, ids))
            rows = {}
            await asyncio.sleep(0.5)
            _publish(gw, 1, v1, fp1)
            rows[1] = await _settled(gw, 1)
            await asyncio.sleep(0.3)
            _publish(gw, 2, v2, fp2)
            rows[2] = await _settled(gw, 2)
            await asyncio.sleep(0.3)
            _publish(gw, 3, v3, fp3)  # the next publish after a refusal goes through
            rows[3] = await _settled(gw, 3)
            await asyncio.sleep(0.3)
            # (4) an engine that acknowledges the reload but keeps its old weights
            (member,) = gw.state.backends.backends
            client = member.client
            real = client.update_weights_from_disk

            async def acknowledge_only(
                model_path: str, weight_version: str | None = None, **kw: object
            ) -> str:
                if model_path == str(v4):
                    return "Succeeded to update model weights."
                return await real(model_path, weight_version, **kw)  # type: ignore[arg-type]

            client.update_weights_from_disk = acknowledge_only  # type: ignore[method-assign]
            _publish(gw, 4, v4, fp4)
            rows[4] = await _settled(gw, 4)
            client.update_weights_from_disk = real  # type: ignore[method-assign]
            await asyncio.sleep(0.3)
            stop.set()
            await traffic
            return failures, ids, rows

        failures, ids, rows = asyncio.run(drive())
        for v, r in rows.items():  # the closing note's table (pytest -s)
            print(f"v{v}", r.metadata["verify"], r.metadata.get("swap_s"))
        assert not failures, failures
        verdicts = {v: r.metadata["verify"] for v, r in rows.items()}
        assert not verdicts[1]["refused"] and not verdicts[3]["refused"], verdicts
        assert verdicts[2]["refused"] and verdicts[2]["rolled_back_to"] == 1, verdicts[2]
        assert verdicts[4]["refused"] and verdicts[4]["rolled_back_to"] == 3, verdicts[4]
        (d1,) = (e["max_abs_diff"] for e in verdicts[1]["engines"].values())
        (d2,) = (e["max_abs_diff"] for e in verdicts[2]["engines"].values())
        (d4,) = (e["max_abs_diff"] for e in verdicts[4]["engines"].values())
        assert d1 < 1e-4 < verdicts[1]["tolerance"] < d2, verdicts
        assert d4 > verdicts[4]["tolerance"], verdicts[4]
        assert gw.state.live_version == 3
        assert httpx.get(f"{engine}/model_info").json()["weight_version"] == "3"
        assert "live_at" not in rows[2].metadata and "live_at" not in rows[4].metadata
        # tokens generated meanwhile carry verified versions only
        records = [gw.state.store.get_completion(c) for c in ids]
        assert records and all(r is not None for r in records)
        seen = {v for r in records for v in r.output_versions}
        assert seen <= {0, 1, 3} and 3 in seen, seen
        totals = gw.state.metrics.totals("areal_swap_rollbacks")["areal_swap_rollbacks"]
        assert totals == {("default", engine): 2.0}, totals
        page = _console(gw, "/console/policies/default")
        assert "v2 refused by the swap canary" in page and "went back to v1" in page
        assert "v4 refused by the swap canary" in page and "went back to v3" in page
        metrics = httpx.get(
            f"{gw.url}/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}
        ).text
        assert "areal_swap_verify_seconds_count" in metrics
        assert "areal_swap_verify_max_abs_diff" in metrics


def test_swap_without_fingerprint_goes_live_unchecked(tmp_path, tiny_model_dir):
    """A row without a fingerprint (published before verification was on) is swapped as
    before; nothing is scored."""
    v1 = make_weight_variant(tiny_model_dir, tmp_path / "v1", seed=301)
    with _verified_gateway(tmp_path, tiny_model_dir) as (engine, gw):
        gw.state.store.add_weight_version(WeightVersionRecord(version=1, path=str(v1)))

        async def wait() -> None:
            while gw.state.live_version < 1:
                await asyncio.sleep(0.02)

        asyncio.run(asyncio.wait_for(wait(), 60))
        assert "verify" not in gw.state.store.get_weight_version(1).metadata


def _episodes(gw, n_groups: int) -> None:
    """Rewarded two-session groups through the gateway (what the trainer claims)."""
    http = httpx.Client(base_url=gw.url, timeout=60)
    for g in range(n_groups):
        started = http.post(
            "/rl/sessions", json={"group_size": 2}, headers={"authorization": f"Bearer {ADMIN_KEY}"}
        )
        for j, s in enumerate(started.json()["sessions"]):
            auth = {"authorization": f"Bearer {s['api_key']}"}
            body = {**CHAT, "messages": [{"role": "user", "content": f"count to {g}"}]}
            assert http.post("/v1/chat/completions", json=body, headers=auth).status_code == 200
            reward = {"session_id": s["session_id"], "value": j + 0.25 * g, "end_session": True}
            assert http.post("/v1/rewards", json=reward, headers=auth).status_code == 201


@contextlib.contextmanager
def _training_gateway(
    tmp_path: Path, model_dir: Path, steps: int, *extra: str
) -> Iterator[tuple[str, Gateway]]:
    """A local engine and a verifying gateway set up for the real trainer: one group of
    two sessions per step, `steps` steps, no staleness gate."""
    with (
        start_engine_in_thread(model_dir) as engine,
        run_gateway(
            tmp_path,
            model_dir,
            [engine],
            "gateway.router.weight_poll_interval_s=0.02",
            "gateway.sessions.staleness_gate=false",
            "swap_verify.enabled=true",
            "trainer.group_size=2",
            "trainer.batch_groups=1",
            "trainer.lr=1e-3",
            f"trainer.total_steps={steps}",
            *extra,
        ) as gw,
    ):
        yield engine, gw


def test_training_run_verifies_every_swap(tmp_path, tiny_model_dir):
    """The real trainer publishes a fingerprint with each version; the gateway verifies
    every swap of the run and refuses none (fp32 CPU: the engine reproduces the
    trainer's logprobs to well under the tolerance, far from the previous version's)."""
    from support.trainer_run import train_in_thread

    steps = 3
    with _training_gateway(tmp_path, tiny_model_dir, steps) as (engine, gw):
        _episodes(gw, n_groups=steps)
        train_in_thread(gw.config, timeout_s=180)

        async def judged() -> list[WeightVersionRecord]:
            return [await _settled(gw, v) for v in range(1, steps + 1)]

        rows = asyncio.run(judged())
        for r in rows:  # the closing note's table (pytest -s)
            v = r.metadata["verify"]
            (e,) = v["engines"].values()
            print(
                f"v{r.version} diff {e['max_abs_diff']:.2e} contrast {v['contrast']:.3g} "
                f"verify {e['seconds'] * 1e3:.1f} ms swap {r.metadata['swap_s'] * 1e3:.1f} ms"
            )
            assert not v["refused"] and e["max_abs_diff"] < 1e-4, v
            assert v["contrast"] > v["tolerance"], v  # the check could tell v from v-1
            assert len(r.metadata["canary"]["sequences"]) == 3
        assert gw.state.live_version == steps
        assert httpx.get(f"{engine}/model_info").json()["weight_version"] == str(steps)


def test_adapter_at_the_wrong_scale_is_refused_for_its_policy_alone(tmp_path, tiny_model_dir):
    """(3) A policy's adapter applied at another scale than it was trained (and
    fingerprinted) at loads without an error; the canary refuses it, that policy's
    adapter goes back to its verified version, and the other policy's adapter and
    version are not touched."""
    from safetensors.torch import load_file, save_file
    from support.canary import fingerprint_of_model, lora_adapter
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    s1 = lora_adapter(tiny_model_dir, tmp_path / "solver-v1", seed=1)
    s2 = lora_adapter(tiny_model_dir, tmp_path / "solver-v2", seed=2)
    w1 = lora_adapter(tiny_model_dir, tmp_path / "verifier-v1", seed=3)
    fps = {
        ("solver", 1): fingerprint_of_model(s1, tiny_model_dir, base),
        ("solver", 2): fingerprint_of_model(s2, tiny_model_dir, s1),
        ("verifier", 1): fingerprint_of_model(w1, tiny_model_dir, base),
    }
    # applied at 4x the trained scale (a changed lora_alpha the engine refuses itself,
    # as another shape; the same update scaled in the tensors loads without a word)
    file = tmp_path / "solver-v2" / "adapter_model.safetensors"
    state = load_file(file)
    save_file({k: v * 4 if "lora_B" in k else v for k, v in state.items()}, file)
    with (
        start_engine_in_thread(tiny_model_dir) as engine,
        run_gateway(
            tmp_path / "gw",
            tiny_model_dir,
            [engine],
            "gateway.router.weight_poll_interval_s=0.02",
            "swap_verify.enabled=true",
            "trainer.lora.rank=8",
            "trainer.lora.alpha=16",
            "policies=[{name: solver}, {name: verifier}]",
        ) as gw,
    ):
        store = gw.state.store

        def publish(policy: str, version: int) -> WeightVersionRecord:
            path = tmp_path / f"{policy}-v{version}"
            meta = {"canary": fps[policy, version]}
            store.add_weight_version(
                WeightVersionRecord(version=version, path=str(path), metadata=meta, policy=policy)
            )

            async def judged() -> WeightVersionRecord:
                deadline = asyncio.get_running_loop().time() + 60
                while True:
                    row = store.get_weight_version(version, policy)
                    verdict = row.metadata.get("verify")
                    if verdict and (verdict["refused"] or "live_at" in row.metadata):
                        return row
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.05)

            return asyncio.run(judged())

        assert not publish("solver", 1).metadata["verify"]["refused"]
        assert not publish("verifier", 1).metadata["verify"]["refused"]
        refused = publish("solver", 2).metadata["verify"]
        assert refused["refused"] and refused["rolled_back_to"] == 1, refused
        (diff,) = (e["max_abs_diff"] for e in refused["engines"].values())
        assert diff > refused["tolerance"]
        assert gw.state.policy_versions == {"solver": 1, "verifier": 1}
        info = httpx.get(f"{engine}/model_info").json()
        assert info["adapter_versions"] == {"solver": "1", "verifier": "1"}, info
        assert "live_at" not in store.get_weight_version(2, "solver").metadata
        # the rolled-back adapter is v1's again: it reproduces v1's fingerprint
        seq = fps["solver", 1]["sequences"][0]
        scored = httpx.post(
            f"{engine}/generate",
            json={
                "input_ids": seq["ids"],
                "return_logprob": True,
                "logprob_start_len": seq["start"],
                "lora_path": "solver",
                "sampling_params": {"max_new_tokens": 1},
            },
        ).json()["meta_info"]["input_token_logprobs"]
        got = [t[0] for t in scored]
        assert max(abs(a - b) for a, b in zip(got, seq["logprobs"], strict=True)) < 1e-4


def test_trainer_stops_advancing_after_repeated_refusals(tmp_path, tiny_model_dir, caplog):
    """(4) end to end: an engine that acknowledges every reload but keeps its weights
    makes the gateway refuse each version the real trainer publishes; after
    `swap_verify.max_failures` refusals in a row the trainer stops advancing (well
    before `total_steps`), saying which versions, engines and differences refused it,
    and the engine still serves the weights it started from."""
    from support.trainer_run import train_in_thread

    steps, max_failures = 12, 2
    limit = f"swap_verify.max_failures={max_failures}"
    with _training_gateway(tmp_path, tiny_model_dir, steps, limit) as (engine, gw):
        (member,) = gw.state.backends.backends
        real = member.client.update_weights_from_disk
        start = str(tiny_model_dir.resolve())

        async def keeps_old_weights(
            model_path: str, weight_version: str | None = None, **kw: object
        ) -> str:
            if model_path != start:  # only the rollback to the starting weights loads
                return "Succeeded to update model weights."
            return await real(model_path, weight_version, **kw)  # type: ignore[arg-type]

        member.client.update_weights_from_disk = keeps_old_weights  # type: ignore[method-assign]
        _episodes(gw, n_groups=steps)
        with caplog.at_level("ERROR", logger="trainer.train"):
            train_in_thread(gw.config, timeout_s=300)
        published = gw.state.store.list_weight_versions(limit=100)
        judged = [r for r in published if "verify" in r.metadata]
        assert len(judged) >= max_failures and all(r.metadata["verify"]["refused"] for r in judged)
        assert 0 < len(published) < steps, [r.version for r in published]  # stopped early
        why = [r.getMessage() for r in caplog.records if "stops advancing" in r.getMessage()]
        assert len(why) == 1, caplog.text
        assert f"refused the last {max_failures} published versions of policy default" in why[0]
        assert engine in why[0]
        assert gw.state.live_version == 0
        assert httpx.get(f"{engine}/model_info").json()["weight_version"] == "0"
