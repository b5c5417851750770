"""A newcomer's mistakes end in one sentence that names the cause and the next step, in
about a second, with no traceback; and nothing reports a success it did not have. Each
test runs the real `areal-service` command as a user would (a subprocess)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.loopback import free_port

from launcher.processes import ChildProcess, StartError, cli_argv

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli_argv(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single line the command printed on stderr (no traceback, no usage box)."""
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("areal-service: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def _ports(tmp_path: Path) -> list[str]:
    return [
        "--set",
        f"data_dir={tmp_path / 'data'}",
        "--set",
        f"gateway.port={free_port()}",
        "--set",
        f"engine.port={free_port()}",
    ]


def test_serve_with_a_missing_model_names_the_path(tmp_path):
    started = time.monotonic()
    result = _run("serve", "--set", f"engine.model={tmp_path / 'nope'}", *_ports(tmp_path))
    assert result.returncode == 1
    assert _one_line(result) == (
        f"areal-service: model {tmp_path / 'nope'} does not exist: engine.model (or --model) "
        "must be a folder holding a Hugging Face checkpoint; leave engine.model unset for "
        "the tiny model"
    )
    assert time.monotonic() - started < 30  # no engine was started and waited on
    assert not (tmp_path / "data" / "logs" / "engine.log").exists()


def test_eval_with_a_missing_version_lists_the_published_ones(tmp_path):
    weights = tmp_path / "data" / "weights"
    for v in ("v2", "v10"):
        (weights / v).mkdir(parents=True)
    result = _run(
        "eval",
        "--config",
        "examples/math/eval.yaml",
        "--model",
        str(weights / "v12"),
        *_ports(tmp_path),
    )
    assert result.returncode == 1
    assert (
        f"model {weights / 'v12'} does not exist (published versions in {weights}: v2, v10)"
    ) in _one_line(result)


def test_a_folder_that_is_not_a_model_is_refused(tmp_path):
    (tmp_path / "notamodel").mkdir()
    result = _run("serve", "--set", f"engine.model={tmp_path / 'notamodel'}", *_ports(tmp_path))
    assert result.returncode == 1
    assert _one_line(result).startswith(
        f"areal-service: {tmp_path / 'notamodel'} is not a model checkpoint (no config.json"
    )


def test_a_child_that_dies_before_ready_names_its_log(tmp_path):
    log = tmp_path / "engine.log"
    child = ChildProcess(
        "engine",
        [sys.executable, "-c", "print('OSError: weights.safetensors not found'); exit(3)"],
        log_path=log,
    )
    with pytest.raises(StartError) as info:
        child.wait_http_ok(f"http://127.0.0.1:{free_port()}/health", timeout_s=30)
    child.stop()
    assert str(info.value) == (
        "engine exited with code 3 before it was ready; last log line: "
        f"OSError: weights.safetensors not found; full log: {log}"
    )


@pytest.mark.parametrize(
    ("command", "busy"),
    [("demo", "gateway.port"), ("demo", "engine.port"), ("serve", "gateway.port")],
)
def test_commands_refuse_ports_another_server_holds(tmp_path, command, busy):
    """A demo beside a running `serve` used to run against that server and exit 0; a
    second `serve` started its engine, then died on the port with a traceback."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        args = [*_ports(tmp_path), "--set", f"{busy}={port}"]
        result = _run(command, *args)
    assert result.returncode == 1
    assert _one_line(result) == (
        f"areal-service: port {port} on 127.0.0.1 ({busy}) is already in use, probably by "
        "another `areal-service serve` or `demo`: stop it, or choose free ports with "
        "--set gateway.port=... --set engine.port=..."
    )
    assert "summary" not in result.stdout


def test_demo_with_a_registry_model_checks_ports_before_building_it(tmp_path):
    """It used to spend most of a minute building SmolLM2, then say the port was busy."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        started = time.monotonic()
        result = _run(
            "demo", "--model", "smollm2-135m-instruct", *_ports(tmp_path),
            "--set", f"gateway.port={port}",
        )  # fmt: skip
    assert result.returncode == 1
    assert _one_line(result).startswith(f"areal-service: port {port} on 127.0.0.1 (gateway.port)")
    assert time.monotonic() - started < 20
    assert not (tmp_path / "data" / "models").exists()  # nothing was built


def _unwritable_data_dir(tmp_path: Path) -> tuple[Path, str]:
    """A data dir the command cannot create: a read-only folder's child for a plain user;
    for root (CI), whom permissions do not stop, one in sysfs, which refuses new files."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        return locked / "data", "Permission denied"
    sysfs = Path("/sys")
    if not sysfs.is_dir():
        pytest.skip("running as root without sysfs: no folder refuses root's writes")
    return sysfs / f"areal-test-{os.getpid()}", "Operation not permitted"


@pytest.mark.parametrize("command", [["keys", "create"], ["serve"], ["demo"]])
def test_an_unwritable_data_dir_is_one_line(tmp_path, command):
    """It used to end in a 34- to 79-line Rich traceback of pathlib's mkdir."""
    data, reason = _unwritable_data_dir(tmp_path)
    result = _run(*command, *_ports(tmp_path), "--set", f"data_dir={data}")
    assert result.returncode == 1
    assert _one_line(result) == (
        f"areal-service: cannot write {data}: {reason} (the data dir must be writable: fix its "
        "permissions, or pick another folder with --set data_dir=DIR)"
    )
    assert len(result.stderr.splitlines()) == 1


def test_a_file_where_the_data_dir_belongs_is_one_line(tmp_path):
    (tmp_path / "data").write_text("not a folder")
    result = _run("keys", "create", "--set", f"data_dir={tmp_path / 'data' / 'inner'}")
    assert result.returncode == 1
    assert _one_line(result) == (
        f"areal-service: {tmp_path / 'data'} is a file, not a folder, so "
        f"{tmp_path / 'data' / 'inner' / 'admin_key'} cannot be made (is data_dir right? pick "
        "another folder with --set data_dir=DIR)"
    )


def test_a_second_demo_in_the_same_folder_says_how_to_start_fresh(tmp_path):
    """It used to resume the finished run, train nothing, and report the trained model as
    its untrained baseline and the target as met."""
    data = tmp_path / "data"
    (data / "weights" / "v40").mkdir(parents=True)
    result = _run("demo", *_ports(tmp_path))
    assert result.returncode == 2
    assert _one_line(result) == (
        f"areal-service: {data} holds an earlier run (published weights up to v40 in "
        f"{data / 'weights'}): the demo would resume it, train nothing and measure the "
        "trained model as its baseline. Start over with `areal-service demo --fresh` "
        "(deletes that run, keeps the model and the admin key), or use another folder: "
        "--set data_dir=..."
    )


def test_fresh_deletes_the_run_and_keeps_model_and_key(tmp_path):
    from areal_service.config import load_config
    from launcher.earlier_run import fresh_start, previous_run

    config = load_config(overrides=[f"data_dir={tmp_path}"])
    assert previous_run(config) is None
    for folder in ("weights/v3", "checkpoints/step-3", "demo", "tiny-model", "logs"):
        (tmp_path / folder).mkdir(parents=True)
    for name in ("areal.db", "admin_key", "tiny-model/config.json"):
        (tmp_path / name).write_text("x")
    assert "v3" in (previous_run(config) or "")
    gone = fresh_start(config)
    assert sorted(p.name for p in gone) == ["areal.db", "checkpoints", "demo", "weights"]
    assert previous_run(config) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["admin_key", "logs", "tiny-model"]


def _silent_server() -> tuple[socket.socket, threading.Event]:
    """A loopback server that accepts and never answers: episodes stay in flight."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    accepted = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            accepted.set()

    threading.Thread(target=accept, daemon=True).start()
    return server, accepted


def test_ctrl_c_during_eval_is_one_clean_line(tmp_path):
    server, accepted = _silent_server()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    proc = subprocess.Popen(
        cli_argv(
            "eval",
            "--config",
            "examples/math/eval.yaml",
            "--gateway",
            url,
            "--api-key",
            "sk-x",
            "--set",
            f"data_dir={tmp_path}",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )  # SIGABRT then dumps every thread
    try:
        assert accepted.wait(60), "eval never reached the gateway"
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # say where it hangs, not only that it does
            os.kill(proc.pid, signal.SIGABRT)
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"eval still ran 60 s after Ctrl-C; where its threads were:\n{err[-8000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
        server.close()
    assert proc.returncode == 130
    assert "Traceback" not in err and "never retrieved" not in err, err
    assert (
        "interrupted (0 of 1 dataset(s) finished); every process was stopped; nothing saved" in out
    )
    assert not (tmp_path / "eval" / "results.json").exists()


class _Finalizer:
    def __del__(self) -> None:
        signal.raise_signal(signal.SIGTERM)  # handled while this finalizer runs
        time.sleep(0.01)


def test_sigterm_landing_in_a_finalizer_still_stops_the_command():
    """A SIGTERM handled inside some object's `__del__` used to raise SystemExit there,
    where Python prints and drops it: the demo then ran on to "target met", exit 0."""
    from launcher.processes import exit_on_sigterm

    with pytest.raises(SystemExit) as info, exit_on_sigterm():
        _Finalizer()  # collected at once: the signal arrives in its __del__
        time.sleep(5)  # the re-delivered signal ends this
    assert info.value.code == 128 + signal.SIGTERM


@pytest.mark.parametrize(
    "model", [[], ["--model", "smollm2-135m-instruct"]], ids=["tiny", "registry"]
)
def test_serve_after_a_demo_names_the_demo_run_and_offers_fresh(tmp_path, model):
    data = tmp_path / "data"
    (data / "weights" / "v40").mkdir(parents=True)
    (data / "demo").mkdir()
    started = time.monotonic()
    result = _run("serve", *_ports(tmp_path), *model)
    assert result.returncode == 1
    line = _one_line(result)
    assert line.startswith(
        f"areal-service: {data} holds the demo's run (published weights up to v40 in "
        f"{data / 'weights'}): serve's trainer would continue it, training its leftover "
        "episodes before yours. Start over with `areal-service serve --fresh`"
    ), line
    assert "--set data_dir=..." in line and "(--no-train)" in line
    assert time.monotonic() - started < 30  # before any model loads
    assert not (data / "logs" / "engine.log").exists()
    assert not (data / "models").exists()  # refused before a registry model's build
