"""Verified swaps on a real SGLang-CPU server (SmolLM2-135M, float32): a correct swap is
scored with SGLang's own prompt logprobs (`/generate` with `logprob_start_len`), passes
far below the tolerance and goes live; a publish whose files were corrupted after the
fingerprint (one tensor scaled) is refused at its first swap and rolled back, while
agents are served with no failed request. Skips without AREAL_TEST_SGLANG_PYTHON, as the
other SGLang tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.canary import fingerprint_of, scale_one_tensor
from support.harness import run_gateway
from support.sglang_cpu import cpu_config, sglang_servers
from test_swap_verify_vllm import _run

from engine.testing import make_weight_variant


@pytest.fixture(scope="module")
def smollm2_dir(sglang_python: str, smollm2_checkpoint: Path) -> Path:
    return smollm2_checkpoint  # built only after the skip check


@pytest.fixture(scope="module")
def sglang_url(
    tmp_path_factory: pytest.TempPathFactory, sglang_python: str, smollm2_dir: Path
) -> Iterator[str]:
    """One SGLang server on the CPU, with the launcher's CPU flags."""
    config = cpu_config(tmp_path_factory.mktemp("sglang"), smollm2_dir, sglang_python)
    with sglang_servers(config) as supervisor:
        yield supervisor.urls[0]


def test_correct_swap_verifies_and_corrupted_one_is_rolled_back(tmp_path, smollm2_dir, sglang_url):
    base = smollm2_dir
    good = make_weight_variant(base, tmp_path / "v1", seed=21)
    corrupted = make_weight_variant(base, tmp_path / "v2", seed=22)
    steps = [
        (1, good, fingerprint_of(good, base, base)),
        (2, corrupted, fingerprint_of(corrupted, base, good)),
    ]
    scale_one_tensor(corrupted)  # after its fingerprint
    with run_gateway(
        tmp_path / "gw",
        base,
        [sglang_url],
        "engine.backend=sglang",
        "gateway.router.weight_poll_interval_s=0.05",
        "swap_verify.enabled=true",
    ) as gw:
        failures, rows = _run(gw, steps)
        assert gw.state.live_version == 1
        assert httpx.get(f"{sglang_url}/model_info").json()["weight_version"] == "1"
    assert not failures, failures
    for v, meta in rows.items():  # the closing note's table (pytest -s)
        verdict = meta["verify"]
        (engine,) = verdict["engines"].values()
        print(
            f"SGLang v{v}: diff {engine['max_abs_diff']} contrast {verdict['contrast']:.3g} "
            f"verify {engine['seconds'] * 1e3:.0f} ms refused {verdict['refused']}"
        )
    ok, bad = rows[1]["verify"], rows[2]["verify"]
    (d1,) = (e["max_abs_diff"] for e in ok["engines"].values())
    assert not ok["refused"] and d1 < ok["tolerance"] < ok["contrast"], ok
    assert "live_at" in rows[1]
    assert bad["refused"] and bad["rolled_back_to"] == 1, bad
    assert "live_at" not in rows[2]
