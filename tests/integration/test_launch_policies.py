"""`areal-service launch --scheduler local` with named policies: besides the default
policy's trainer it starts one `trainer --policy NAME` per policy of the config, and one
for a policy created at runtime through the admin API while it runs, which it stops when
that policy is deleted; SIGTERM to the launcher stops exactly the processes it started,
each trainer in order."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from support.loopback import free_port, pid_alive

from launcher.processes import cli_argv

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": "Bearer sk-launch"}


def _descendants(pid: int) -> dict[int, str]:
    """Every descendant of `pid` (from /proc) and its command line."""
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child in kids.get(todo.pop(0), []):
            try:
                out[child] = (
                    Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                )
            except OSError:
                continue
            todo.append(child)
    return out


def _trainers(pid: int) -> dict[str, int]:
    """The launcher's trainer processes by policy (`default` for the one without --policy)."""
    found = {}
    for child, cmd in _descendants(pid).items():
        words = cmd.split()
        if "launcher" in words and "trainer" in words:
            policy = words[words.index("--policy") + 1] if "--policy" in words else "default"
            found[policy] = child
    return found


def _wait(what: str, check, log: Path, timeout_s: float = 120) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}; launcher log:\n{log.read_text()[-3000:]}"
        time.sleep(0.3)


def test_launch_starts_one_trainer_per_policy_and_stops_them(tmp_path, tiny_model_dir):
    gw_port = free_port()
    log = tmp_path / "launch.log"
    sets = [
        f"data_dir={tmp_path}",
        f"engine.model={tiny_model_dir}",
        f"engine.port={free_port()}",
        f"gateway.port={gw_port}",
        "gateway.auth.admin_key=sk-launch",
        "engine.torch_threads=1",
        "trainer.torch_threads=1",
        "trainer.lora.rank=4",
        "policies=[{name: solver}]",
    ]
    proc = subprocess.Popen(
        cli_argv("launch", "--scheduler", "local", *(a for s in sets for a in ("--set", s))),
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),  # noqa: SIM115
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{gw_port}"
    try:
        _wait(
            "the config's two trainers never started",
            lambda: proc.poll() is None and set(_trainers(proc.pid)) == {"default", "solver"},
            log,
        )
        made = httpx.post(
            f"{url}/admin/policies",
            json={"name": "critic", "lora": {"rank": 2}},
            headers=ADMIN,
            timeout=30,
        )
        assert made.status_code == 201, made.text
        _wait(
            "no trainer started for the runtime policy",
            lambda: set(_trainers(proc.pid)) == {"default", "solver", "critic"},
            log,
            timeout_s=30,
        )
        assert (tmp_path / "logs" / "trainer-critic.log").exists()
        # The runtime policy's trainer got as far as running (its config resolved from
        # the store): still alive a few seconds on, like the others.
        time.sleep(8)
        trainers = _trainers(proc.pid)
        assert set(trainers) == {"default", "solver", "critic"}, log.read_text()[-3000:]
        descendants = list(_descendants(proc.pid))
        # Deleted, the runtime policy's trainer is stopped by the launcher; the others run on.
        gone = httpx.delete(f"{url}/admin/policies/critic", headers=ADMIN, timeout=30)
        assert gone.status_code == 200, gone.text
        _wait(
            "the deleted policy's trainer was not stopped",
            lambda: set(_trainers(proc.pid)) == {"default", "solver"},
            log,
            timeout_s=60,
        )
        assert "policy critic was deleted: stopping its trainer" in log.read_text()
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(120)
    text = log.read_text()
    assert code == 128 + signal.SIGTERM, text[-3000:]
    lines = [line.rstrip() for line in text.splitlines()]
    for name in ("trainer", "trainer-solver", "trainer-critic"):
        assert any(line.endswith(f"stopped {name}") for line in lines), text[-3000:]
    assert "had exited with code" not in text, text[-3000:]
    deadline = time.monotonic() + 30
    while any(pid_alive(p) for p in descendants) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in descendants), "a child outlived the launcher"
