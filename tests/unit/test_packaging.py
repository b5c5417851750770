"""What pyproject.toml promises matches the code: the Python floor and the dependency
sets (the base install is torch-free; the torch-needing parts are the `train` extra)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_python_floor_is_311_everywhere():
    # asyncio.timeout (gateway/http1.py) and Task.uncancel (gateway/hotpath.py) are 3.11.
    project = PYPROJECT["project"]
    assert project["requires-python"] == ">=3.11"
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py311"
    versions = {
        c.rsplit(" :: ", 1)[-1]
        for c in project["classifiers"]
        if c.startswith("Programming Language :: Python :: 3.")
    }
    assert min(versions, key=lambda v: tuple(map(int, v.split(".")))) == "3.11"
    assert "3.10" not in (ROOT / "README.md").read_text().split("## Set-up")[1][:400]


def test_no_unused_settings_dependency():
    # config/loading.py merges file, environment and overrides itself; nothing imports
    # pydantic_settings, so it is no dependency either.
    deps = " ".join(PYPROJECT["project"]["dependencies"])
    assert "pydantic-settings" not in deps
    for package in ("areal_service", "engine", "gateway", "trainer", "launcher"):
        for path in (ROOT / package).rglob("*.py"):
            assert "pydantic_settings" not in path.read_text(), path


TORCH_SIDE = {"torch", "transformers", "safetensors", "tensorboard", "gguf", "accelerate", "peft"}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_base_and_gateway_installs_are_torch_free():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert not _names(PYPROJECT["project"]["dependencies"]) & TORCH_SIDE
    assert not _names(extras["gateway"]) & TORCH_SIDE
    assert TORCH_SIDE <= _names(extras["train"])


def test_full_and_dev_installs_keep_everything():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert "areal-service[gateway,train,postgres]" in extras["full"]
    assert "areal-service[full]" in extras["dev"]
    assert "areal-service[gateway]" in extras["train"]


def test_each_extras_module_is_in_its_extra():
    # launcher/extras.py names the extra to install for a missing import; it must name the
    # extra that really brings that package.
    from launcher.extras import EXTRA_OF_MODULE

    package_of = {
        "prometheus_client": "prometheus-client",
        "agents": "openai-agents",
        "math_verify": "math-verify",
        "starlette": "fastapi",
    }
    extras = PYPROJECT["project"]["optional-dependencies"]
    for module, extra in EXTRA_OF_MODULE.items():
        assert package_of.get(module, module) in _names(extras[extra]), (module, extra)


def test_runs_print_their_slowest_tests_and_wall_time():
    assert "--durations=20" in PYPROJECT["tool"]["pytest"]["ini_options"]["addopts"]


def test_a_fast_test_cannot_start_a_process(request):
    # tests/conftest.py marks this test `fast` (tests/unit, no `processes` mark) and then
    # refuses processes in it: the `fast` subset cannot silently grow slow.
    assert request.node.get_closest_marker("fast") is not None
    with pytest.raises(AssertionError, match="marked fast"):
        subprocess.run(["true"], check=False)
