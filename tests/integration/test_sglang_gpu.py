"""SGLang through the whole service: `areal-service serve` with `engine.backend=sglang`
launches a server, the gateway routes chat to it, captures every completion (ids,
logprobs, versions), swaps in a published version (disk path), and stopping serve stops
the server.

`gpu`: real SGLang with a small real checkpoint. Set AREAL_TEST_SGLANG_MODEL to an HF
checkpoint directory (e.g. Qwen2.5-0.5B-Instruct) and, when SGLang lives in another
venv, AREAL_TEST_SGLANG_PYTHON to its interpreter. `slow`: the same test with real
SGLang on the CPU (AREAL_TEST_SGLANG_PYTHON, the venv scripts/build_sglang_venv.sh
builds; the launcher's CPU flags, the project's stand-in `sgl_kernel`) serving
SmolLM2-135M-Instruct, which keeps the GPU test's path runnable where no GPU is lent.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from support.loopback import free_port

from areal_service.config import load_config
from areal_service.store import TrajectoryStore
from areal_service.types import WeightVersionRecord
from launcher.processes import cli_argv, save_config

KEY = "sk-sglang-test"


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(what)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def chat_capture_swap(
    tmp_path: Path,
    model_dir: Path,
    python: str,
    env: dict[str, str],
    ready_s: float,
    gpus: str = "[0]",
) -> None:
    engine_port, gw_port = free_port(), free_port()
    backend = f"http://127.0.0.1:{engine_port}"
    cfg = load_config(
        None,
        [
            f"data_dir={tmp_path}",
            "engine.backend=sglang",
            f"engine.model={model_dir}",
            f"engine.port={engine_port}",
            f"gateway.port={gw_port}",
            f"gateway.auth.admin_key={KEY}",
            f"engine.sglang.gpus={gpus}",
            "engine.sglang.servers=1",
            f"engine.sglang.python={python}",
            "engine.sglang.mem_fraction_static=0.6",
            f"engine.sglang.ready_timeout_s={ready_s}",
            "gateway.router.weight_poll_interval_s=0.05",
        ],
    )
    log = tmp_path / "serve.log"
    serve = subprocess.Popen(
        cli_argv("serve", "--config", str(save_config(cfg, tmp_path / "cfg.yaml"))),
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),  # noqa: SIM115
        env={**os.environ, **env},
        start_new_session=True,
    )
    store = None
    try:
        gw = f"http://127.0.0.1:{gw_port}"
        _wait(
            lambda: serve.poll() is None and _ok(f"{gw}/health/liveness"),
            ready_s + 60,
            f"gateway not up: {log.read_text()[-3000:] if log.exists() else ''}",
        )
        assert _ok(f"{backend}/health_generate")  # the server serve launched
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key=KEY, max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "Name three colours."}]
        first = client.chat.completions.create(
            model=cfg.gateway.model_name, messages=messages, max_tokens=24
        )
        assert first.usage.completion_tokens > 0
        store = TrajectoryStore.open(cfg.database_url(), cfg.store)
        rec = store.get_completion(first.id)
        assert rec is not None and rec.backend == backend
        assert len(rec.output_ids) == len(rec.output_logprobs) == first.usage.completion_tokens
        assert set(rec.output_versions) == {0}

        published = tmp_path / "weights" / "v1"  # what the trainer publishes (same weights)
        shutil.copytree(model_dir, published)
        store.add_weight_version(WeightVersionRecord(version=1, path=str(published)))
        _wait(lambda: "swap_s" in store.get_weight_version(1).metadata, 600, "no swap")
        info = httpx.get(f"{backend}/model_info", timeout=30).json()
        assert info["weight_version"] == "1"
        second = client.chat.completions.create(
            model=cfg.gateway.model_name,
            max_tokens=24,
            messages=[
                *messages,
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And three more."},
            ],
        )
        assert set(store.get_completion(second.id).output_versions) == {1}
    finally:
        if store is not None:
            store.close()
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(120)
    _wait(lambda: not _ok(f"{backend}/health_generate"), 60, "server outlived serve")


@pytest.mark.gpu
def test_sglang_on_gpu_chat_capture_swap(tmp_path):
    model = os.environ.get("AREAL_TEST_SGLANG_MODEL")
    if not model:
        pytest.skip("set AREAL_TEST_SGLANG_MODEL to a small HF checkpoint directory")
    python = os.environ.get("AREAL_TEST_SGLANG_PYTHON", sys.executable)
    if subprocess.run([python, "-c", "import sglang"], capture_output=True).returncode:
        pytest.skip(f"sglang is not importable by {python} (pip install '.[sglang]')")
    chat_capture_swap(tmp_path, Path(model), python, {}, ready_s=900)


@pytest.mark.slow
def test_sglang_on_cpu_chat_capture_swap(tmp_path, sglang_python, smollm2_checkpoint):
    from support.sglang_cpu import standin_env

    chat_capture_swap(tmp_path, smollm2_checkpoint, sglang_python, standin_env(), 600, gpus="[]")


def _random_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """A trained-looking adapter (A and B random, nonzero) for `model_dir` in PEFT's
    layout, as `trainer.lora` publishes one."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from areal_service.config import LoRAConfig
    from trainer.lora import peft_config

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        peft_config(LoRAConfig(rank=8, alpha=16)),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.03)
    model.save_pretrained(out)
    return out


def policies_on_sglang(
    tmp_path: Path,
    model_dir: Path,
    python: str,
    ready_s: float,
    gpus: str = "[0]",
    env: dict[str, str] | None = None,
) -> None:
    """`serve` on SGLang with `trainer.lora` and one named policy: a key bound to it
    runs on the base model (version 0) until its first adapter; each published version
    is loaded under a versioned name (`/load_lora_adapter`, `solver@v<N>`) while the
    default policy's traffic goes on, the policy's tokens carry its version, and the
    retired name is unloaded once drained."""
    engine_port, gw_port = free_port(), free_port()
    backend = f"http://127.0.0.1:{engine_port}"
    cfg = load_config(
        None,
        [
            f"data_dir={tmp_path}",
            "engine.backend=sglang",
            f"engine.model={model_dir}",
            f"engine.port={engine_port}",
            f"gateway.port={gw_port}",
            f"gateway.auth.admin_key={KEY}",
            f"engine.sglang.gpus={gpus}",
            "engine.sglang.servers=1",
            f"engine.sglang.python={python}",
            "engine.sglang.mem_fraction_static=0.6",
            f"engine.sglang.ready_timeout_s={ready_s}",
            "gateway.router.weight_poll_interval_s=0.05",
            "trainer.lora.rank=8",
            "trainer.lora.alpha=16",
            "policies=[{name: solver}]",
        ],
    )
    log = tmp_path / "serve.log"
    serve = subprocess.Popen(
        cli_argv("serve", "--config", str(save_config(cfg, tmp_path / "cfg.yaml"))),
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),  # noqa: SIM115
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    store = None
    try:
        gw = f"http://127.0.0.1:{gw_port}"
        _wait(
            lambda: serve.poll() is None and _ok(f"{gw}/health/liveness"),
            ready_s + 60,
            f"gateway not up: {log.read_text()[-3000:] if log.exists() else ''}",
        )
        made = httpx.post(
            f"{gw}/admin/keys",
            json={"policy": "solver"},
            headers={"authorization": f"Bearer {KEY}"},
            timeout=30,
        )
        assert made.status_code == 201, made.text
        solver = openai.OpenAI(
            base_url=f"{gw}/v1", api_key=made.json()["api_key"], max_retries=0, timeout=300
        )
        admin = openai.OpenAI(base_url=f"{gw}/v1", api_key=KEY, max_retries=0, timeout=300)
        store = TrajectoryStore.open(cfg.database_url(), cfg.store)
        messages = [{"role": "user", "content": "Name three colours."}]

        def versions(client: openai.OpenAI) -> tuple[set[int], tuple[float, ...]]:
            reply = client.chat.completions.create(
                model="agent", messages=messages, max_tokens=16, temperature=0
            )
            rec = store.get_completion(reply.id)
            return set(rec.output_versions), rec.output_logprobs

        assert versions(solver)[0] == {0}  # the base model: its untrained version

        def adapters() -> set[str]:
            cards = httpx.get(f"{backend}/v1/models", timeout=30).json()["data"]
            return {c["id"] for c in cards if c.get("parent")}

        for version in (1, 2):
            path = _random_adapter(
                model_dir, tmp_path / "weights" / "solver" / f"v{version}", version
            )
            store.add_weight_version(
                WeightVersionRecord(version=version, path=str(path), policy="solver")
            )
            _wait(
                lambda v=version: "swap_s" in store.get_weight_version(v, "solver").metadata,
                300,
                f"solver v{version} never went live",
            )
            swap = store.get_weight_version(version, "solver").metadata["swap"]
            assert all(t["pause_s"] == 0 for t in swap.values())  # no pause
            served, adapted = versions(solver)
            assert served == {version}
            base_versions, base = versions(admin)  # the default policy: untouched
            assert base_versions == {0} and adapted != base
        _wait(lambda: adapters() == {"solver@v2"}, 60, f"solver@v1 not unloaded: {adapters()}")
    finally:
        if store is not None:
            store.close()
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(120)


@pytest.mark.gpu
def test_sglang_on_gpu_serves_policies_by_versioned_adapter_names(tmp_path):
    model = os.environ.get("AREAL_TEST_SGLANG_MODEL")
    if not model:
        pytest.skip("set AREAL_TEST_SGLANG_MODEL to a small HF checkpoint directory")
    python = os.environ.get("AREAL_TEST_SGLANG_PYTHON", sys.executable)
    if subprocess.run([python, "-c", "import sglang"], capture_output=True).returncode:
        pytest.skip(f"sglang is not importable by {python} (pip install '.[sglang]')")
    pytest.importorskip("peft")
    policies_on_sglang(tmp_path, Path(model), python, ready_s=900)


def test_sglang_on_cpu_serves_policies_by_versioned_adapter_names(
    tmp_path, sglang_python, smollm2_checkpoint
):
    """The GPU test above, on the CPU: not possible with SGLang 0.5.23, which allocates
    its LoRA layers' buffers in pinned memory at start and fails without an accelerator
    (measured: the server exits with "pin_memory=True requires a CUDA or other
    accelerator backend"). The launcher refuses such a config in one line instead
    (`sglang_cpu_refusal`, checked in tests/unit/test_sglang_launch.py); this test skips
    with that line (not `slow`: CI reports the skip), and runs the GPU test's path once
    the refusal is lifted."""
    from support.sglang_cpu import standin_env

    from launcher.sglang_servers import sglang_cpu_refusal

    cfg = load_config(
        None,
        [
            f"data_dir={tmp_path}",
            "engine.backend=sglang",
            f"engine.model={smollm2_checkpoint}",
            "engine.sglang.gpus=[]",
            "trainer.lora.rank=8",
            "policies=[{name: solver}]",
        ],
    )
    refusal = sglang_cpu_refusal(cfg)
    if refusal:
        pytest.skip(refusal)
    policies_on_sglang(
        tmp_path, smollm2_checkpoint, sglang_python, ready_s=600, gpus="[]", env=standin_env()
    )
