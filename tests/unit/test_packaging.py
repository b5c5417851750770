"""What pyproject.toml promises matches the code: the Python floor and the dependency
sets (the base install is torch-free; the torch-needing parts are the `train` extra)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_python_floor_is_311_everywhere():
    # asyncio.timeout (gateway/http1.py) and Task.uncancel (gateway/hotpath.py) are 3.11.
    project = PYPROJECT["project"]
    assert project["requires-python"] == ">=3.11"
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py311"
    versions = {c.rsplit(" :: ", 1)[-1] for c in project["classifiers"]
                if c.startswith("Programming Language :: Python :: 3.")}
    assert min(versions, key=lambda v: tuple(map(int, v.split(".")))) == "3.11"
    assert "3.10" not in (ROOT / "README.md").read_text().split("## Set-up")[1][:400]


def test_no_unused_settings_dependency():
    # config.py merges file, environment and overrides itself; nothing imports
    # pydantic_settings, so it is no dependency either.
    deps = " ".join(PYPROJECT["project"]["dependencies"])
    assert "pydantic-settings" not in deps
    for package in ("areal_service", "engine", "gateway", "trainer", "launcher"):
        for path in (ROOT / package).rglob("*.py"):
            assert "pydantic_settings" not in path.read_text(), path
