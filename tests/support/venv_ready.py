"""The engines' venvs that CI builds while the first tests run (.ci/run): a test that
needs one waits here until its build has ended, instead of CI waiting for every build
before the suite starts (the builds take minutes; the first engine test comes minutes
into the suite)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

WAIT_S = 1800.0
"""The longest wait for a build (CI's own limit is longer than the suite needs)."""


def wait_for_build(var: str) -> None:
    """When the environment variable `var` names a status file (.ci/run sets one per venv
    it is still building), wait until the file exists: "0" means built; anything else
    fails the test with the build's exit status (its log follows the suite's in CI's
    output). Without `var`, nothing to wait for."""
    path = os.environ.get(var)
    if not path:
        return
    status = Path(path)
    deadline = time.monotonic() + WAIT_S
    while not status.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"{var}: the venv build did not end within {WAIT_S:.0f} s")
        time.sleep(1.0)
    code = status.read_text().strip()
    if code != "0":
        pytest.fail(f"{var}: the venv build failed (exit {code}); CI prints its log")
