"""`pip install ".[gateway]"` in a fresh venv is the torch-free gateway: it imports, serves a
chat completion against a backend given by URL, and a command that needs torch says which
extra to install in one line. It installs with the lock file (constraints.txt), as the
README does. pip runs with this machine's own configuration (index,
find-links), as a user's would; no package is fetched by hand."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.loopback import free_port

from engine.echo_backend import start_echo_backend

ROOT = Path(__file__).resolve().parents[2]
LOCK = str(ROOT / "constraints.txt")
PACKAGES = ("areal_service", "engine", "gateway", "trainer", "launcher", "migrations")


@pytest.fixture(scope="module")
def gateway_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with this checkout installed as `.[gateway]` (non-editable, from a copy
    so the build leaves nothing in the checkout); its bin/ folder."""
    tmp = tmp_path_factory.mktemp("gateway-install")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in PACKAGES:
        shutil.copytree(
            ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run(
        # The lock file's versions, as the README installs (-c: a pin for what is installed).
        [str(venv / "bin" / "pip"), "install", "-q", "-c", LOCK, f"{src}[gateway]"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    return venv / "bin"


def _clean_env() -> dict[str, str]:
    # Not this checkout on the path, nor config from the test run's environment.
    return {
        k: v
        for k, v in os.environ.items()
        if k != "PYTHONPATH" and not k.startswith("AREAL_") and k != "DATABASE_URL"
    }


def test_gateway_install_has_no_torch(gateway_venv: Path):
    probe = subprocess.run(
        [str(gateway_venv / "python"), "-c", "import torch"],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=60,
    )
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr
    found = subprocess.run(
        [
            str(gateway_venv / "python"),
            "-c",
            "import gateway.app, gateway.console, launcher.cli, launcher.serve, engine.echo_backend; "
            "import sys; print(sorted({'torch', 'transformers'} & set(sys.modules)))",
        ],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=60,
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "[]"


def test_command_needing_torch_names_the_extra(gateway_venv: Path, tmp_path: Path):
    run = subprocess.run(
        [str(gateway_venv / "areal-service"), "make-tiny-model", str(tmp_path / "tiny")],
        capture_output=True,
        text=True,
        env=_clean_env(),
        cwd=tmp_path,
        timeout=60,
    )
    assert run.returncode == 2
    [line] = run.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith("areal-service: this command needs "), line
    assert line.endswith(
        ", which is not installed: install areal-service[train] "
        '(pip install "areal-service[train]")'
    ), line


def test_serve_names_the_extra_for_a_transformers_tokenizer(
    gateway_venv: Path, tiny_model_dir: Path, tmp_path: Path
):
    """A checkpoint whose tokenizer class only transformers builds, served from the
    torch-free install: one line naming the extra, before any process starts."""
    model = tmp_path / "gpt2-class"
    shutil.copytree(tiny_model_dir, model)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "GPT2Tokenizer"
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    model_config = json.loads((model / "config.json").read_text())
    model_config["model_type"] = "gpt2"  # else qwen2's registered class wins
    (model / "config.json").write_text(json.dumps(model_config))
    run = subprocess.run(
        [
            str(gateway_venv / "areal-service"),
            "serve",
            "--set",
            f"data_dir={tmp_path / 'd'}",
            "--set",
            f"engine.model={model}",
            "--set",
            "gateway.router.backends=[http://127.0.0.1:9]",
            "--set",
            f"gateway.port={free_port()}",
            "--set",
            "gateway.auth.admin_key=sk-install-test",
        ],
        capture_output=True,
        text=True,
        env=_clean_env(),
        cwd=tmp_path,
        timeout=60,
    )
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr  # one line, no traceback
    [line] = lines
    assert "needs transformers (tokenizer class GPT2Tokenizer)" in line, line
    assert "install areal-service[train]" in line, line


@pytest.fixture()
def served(gateway_venv: Path, tiny_model_dir: Path, tmp_path: Path) -> Iterator[str]:
    """`areal-service serve` from the gateway venv in front of an echo backend (URL)."""
    port = free_port()
    with start_echo_backend(tokens=4) as echo:
        log = (tmp_path / "serve.log").open("w")
        proc = subprocess.Popen(
            [
                str(gateway_venv / "areal-service"),
                "serve",
                "--set",
                f"data_dir={tmp_path / 'data'}",
                "--set",
                f"engine.model={tiny_model_dir}",
                "--set",
                f"gateway.router.backends=[{echo.url}]",
                "--set",
                f"gateway.port={port}",
                "--set",
                "gateway.auth.admin_key=sk-install-test",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_clean_env(),
            cwd=tmp_path,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "gateway did not come up in 60 s"
                try:
                    if httpx.get(f"{url}/health/readiness", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def test_gateway_install_serves_a_chat_completion(served: str):
    reply = httpx.post(
        f"{served}/v1/chat/completions",
        timeout=30,
        headers={"Authorization": "Bearer sk-install-test"},
        json={
            "model": "areal-policy",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["finish_reason"] == "length"
