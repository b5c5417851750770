"""Multi-worker metrics bookkeeping (`gateway/server.py`): a worker starting where
uvicorn replaced a dead one drops the dead worker's live gauge files (else its last
in-flight count is summed forever) and keeps every counter file (totals)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.server import _forget_dead_workers


@pytest.mark.processes
def test_dead_workers_live_gauges_are_dropped_counters_kept(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    files = [
        f"gauge_livesum_{gone.pid}.db",
        f"gauge_livesum_{os.getpid()}.db",
        f"counter_{gone.pid}.db",
        f"histogram_{gone.pid}.db",
    ]
    for name in files:
        (tmp_path / name).write_bytes(b"")
    _forget_dead_workers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files[1:])
