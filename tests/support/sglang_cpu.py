"""Real SGLang on the CPU for tests: the interpreter (`AREAL_TEST_SGLANG_PYTHON`, a venv
of its own built by scripts/build_sglang_venv.sh), the project's stand-in `sgl_kernel`
on the servers' PYTHONPATH (the CPU build of that package is on no registry), and
servers launched by the project's own supervisor with the launcher's CPU flags.

Without the interpreter the tests skip with the reason; with AREAL_TEST_REQUIRE_SGLANG=1
(CI) the skip is a failure."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from areal_service.config import ServiceConfig, load_config
from launcher.sglang_servers import ServerSpec, Supervisor, sglang_specs
from support.venv_ready import wait_for_build

STANDIN_KERNEL = Path(__file__).resolve().parents[1] / "integration" / "sgl_kernel_standin"
"""The directory holding the stand-in `sgl_kernel` package (a test fixture)."""


def sglang_python_or_skip() -> str:
    """SGLang's interpreter, or the skip (CI: the failure) saying how to get one."""
    python = os.environ.get("AREAL_TEST_SGLANG_PYTHON")
    wait_for_build("AREAL_TEST_SGLANG_READY")  # CI: built while the first tests ran
    if not python:
        reason = (
            "no SGLang configured: set AREAL_TEST_SGLANG_PYTHON to the interpreter of a venv "
            "built by scripts/build_sglang_venv.sh; .ci/run does"
        )
        if os.environ.get("AREAL_TEST_REQUIRE_SGLANG") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return python


def standin_env() -> dict[str, str]:
    """PYTHONPATH with the stand-in kernel first (and what the caller had after it)."""
    rest = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(STANDIN_KERNEL), rest) if p)}


def with_standin(specs: Sequence[ServerSpec]) -> list[ServerSpec]:
    """`specs` whose servers import the stand-in kernel."""
    return [dataclasses.replace(s, env={**s.env, **standin_env()}) for s in specs]


def cpu_config(data_dir: Path, model: Path, python: str, *overrides: str) -> ServiceConfig:
    """`engine.backend=sglang` on the CPU (no GPU listed), on free ports."""
    from support.loopback import free_port

    return load_config(
        overrides=[
            f"data_dir={data_dir}",
            f"engine.model={model}",
            "engine.backend=sglang",
            f"engine.sglang.python={python}",
            "engine.sglang.gpus=[]",
            f"engine.port={free_port()}",
            f"gateway.port={free_port()}",
            "engine.sglang.ready_timeout_s=600",
            "engine.sglang.enable_metrics=false",
            *overrides,
        ]
    )


@contextmanager
def sglang_servers(config: ServiceConfig) -> Iterator[Supervisor]:
    """The servers `config` asks for, launched on the CPU by the project's supervisor
    (with the stand-in kernel), healthy for the block, stopped after; a failed start
    raises with the server's own log."""
    supervisor = Supervisor.for_config(config, with_standin(sglang_specs(config)))
    try:
        supervisor.start()
    except Exception as exc:
        logs = sorted((config.data_dir / "logs").glob("sglang-*.log"))
        tail = "\n".join(f"{p.name}:\n{p.read_text()[-3000:]}" for p in logs) or "(no log)"
        raise RuntimeError(f"SGLang did not start: {exc}\n{tail}") from exc
    try:
        yield supervisor
    finally:
        supervisor.stop()
