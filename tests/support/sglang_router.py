"""SGLang's router (`sglang-router`, a Rust wheel with a Python launcher) for tests: which
interpreter has it, and one router process on a free port.

The interpreter: AREAL_TEST_SGLANG_ROUTER_PYTHON when set, else this one when it can
import `sglang_router` (the `[sglang]` extra), else SGLang's CPU venv
(AREAL_TEST_SGLANG_PYTHON; scripts/build_sglang_venv.sh installs the router there, so CI
has it). Without any, the tests skip with that reason, and with
AREAL_TEST_REQUIRE_SGLANG=1 (CI) fail."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from support.loopback import free_port

ROUTER_VERSION = "0.3.2"
"""The sglang-router the gateway's router client was run against."""


def _has_router(python: str) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec("sglang_router") is not None
    probe = [python, "-c", "import sglang_router"]
    return subprocess.run(probe, capture_output=True, timeout=120).returncode == 0


def router_python_or_skip() -> str:
    """An interpreter that runs `python -m sglang_router.launch_router`, or the skip."""
    candidates = [
        os.environ.get("AREAL_TEST_SGLANG_ROUTER_PYTHON"),
        sys.executable,
        os.environ.get("AREAL_TEST_SGLANG_PYTHON"),
    ]
    for python in filter(None, candidates):
        if _has_router(python):
            return python
    reason = (
        f"sglang-router is not installed (pip install sglang-router=={ROUTER_VERSION}, or "
        "the venv scripts/build_sglang_venv.sh builds, named by AREAL_TEST_SGLANG_PYTHON)"
    )
    if os.environ.get("AREAL_TEST_REQUIRE_SGLANG") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@contextmanager
def run_router(python: str, workers: list[str], log: Path) -> Iterator[str]:
    """`python -m sglang_router.launch_router --policy manual` on a free port in front of
    `workers` (none: added later with `POST /workers`); its URL once ready."""
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                python,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *(["--worker-urls", *workers] if workers else []),
                "--policy",
                "manual",
                "--health-check-interval-secs",
                "1",
                "--log-level",
                "warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:  # up (ready once it has a healthy worker)
                if httpx.get(f"{url}/readiness", timeout=2).status_code == (
                    200 if workers else 503
                ):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "router not ready in 120 s"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
