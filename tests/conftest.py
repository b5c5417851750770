"""Shared fixtures: the tiny model (built once per test session) and marker handling:
`gpu` tests skip without CUDA; every test under tests/unit that is not marked `processes`,
`slow` or `gpu` is marked `fast` (`pytest -m fast`: the sub-minute subset), and a `fast`
test that starts a process fails, so the subset stays what its name says."""

from __future__ import annotations

import multiprocessing.process
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

UNIT = Path(__file__).parent / "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if item.path.is_relative_to(UNIT) and not {"processes", "slow", "gpu"} & set(item.keywords):
            item.add_marker(pytest.mark.fast)


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """In a `fast` test, starting a subprocess or a multiprocessing child fails the test
    (two attribute swaps per test; other tests are untouched)."""
    if request.node.get_closest_marker("fast") is None:
        yield
        return

    def refuse(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise AssertionError(
            f"{request.node.nodeid} is marked fast (tests/unit) but starts a process: "
            "mark it `processes` (pytest.mark.processes)"
        )

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny Qwen2 checkpoint, built once per test session (seconds)."""
    from engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")
