"""SGLang backends: the exact `sglang.launch_server` command lines for a few GPU layouts,
and the supervisor (start, wait healthy, restart on death, give up, stop all) and attach,
exercised with the local engine standing in as the launched command."""

from __future__ import annotations

import importlib.util
import os
import select
import signal
import socket
import sys
import time

import pytest
from support.loopback import free_port, pid_alive

from areal_service.config import load_config
from launcher.processes import cli_argv
from launcher.sglang_servers import (
    ServerSpec,
    Supervisor,
    check_sglang_python,
    gpu_groups,
    sglang_argv,
    sglang_backends,
    sglang_specs,
    wait_healthy,
)

PY = sys.executable


def _cfg(*overrides: str):
    return load_config(None, ["engine.backend=sglang", "engine.model=/ckpt/qwen", *overrides])


def _common(port: int, *, tp: int = 1, dp: int = 1) -> list[str]:
    return [
        PY,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/ckpt/qwen",
        "--served-model-name",
        "/ckpt/qwen",
        "--weight-version",
        "default",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tp-size",
        str(tp),
        "--dp-size",
        str(dp),
        "--log-level",
        "info",
    ]


def test_tp2_on_eight_gpus_is_four_servers_on_consecutive_ports():
    specs = sglang_specs(_cfg("engine.sglang.tp_size=2", "engine.sglang.gpus=[0,1,2,3,4,5,6,7]"))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3", "4,5", "6,7"]
    assert [s.url for s in specs] == [f"http://127.0.0.1:{30000 + i}" for i in range(4)]
    assert [s.name for s in specs] == ["sglang-0", "sglang-1", "sglang-2", "sglang-3"]
    assert list(specs[2].argv) == [*_common(30002, tp=2), "--enable-metrics"]


def test_dp_inside_one_server_with_memory_dtype_context_and_extra_flags():
    cfg = _cfg(
        "engine.sglang.dp_size=2",
        "engine.sglang.servers=1",
        "engine.sglang.gpus=['4','5','6','7']",
        "engine.sglang.mem_fraction_static=0.7",
        "engine.sglang.enable_metrics=false",
        "engine.dtype=bfloat16",
        "engine.context_length=8192",
        "engine.port=31000",
        "engine.weight_version=v3",
        "engine.served_model_name=policy",
        "engine.sglang.python=/venvs/sglang/bin/python",
        "engine.sglang.max_running_requests=48",
        "engine.sglang.extra_args=['--chunked-prefill-size','4096']",
        "log_level=warning",
    )
    [spec] = sglang_specs(cfg)
    assert spec.env == {"CUDA_VISIBLE_DEVICES": "4,5"}  # one server asked for: the first group
    assert list(spec.argv) == [
        "/venvs/sglang/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/ckpt/qwen",
        "--served-model-name",
        "policy",
        "--weight-version",
        "v3",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--tp-size",
        "1",
        "--dp-size",
        "2",
        "--log-level",
        "warning",
        "--max-running-requests",
        "48",
        "--mem-fraction-static",
        "0.7",
        "--context-length",
        "8192",
        "--dtype",
        "bfloat16",
        "--chunked-prefill-size",
        "4096",
    ]


def test_gpus_default_to_cuda_visible_devices_and_wildcard_host_is_advertised(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b,GPU-c")
    specs = sglang_specs(_cfg("engine.host=0.0.0.0"))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["GPU-a", "GPU-b", "GPU-c"]
    assert specs[0].url == f"http://{socket.gethostname()}:30000"
    assert "--host" in specs[0].argv and "0.0.0.0" in specs[0].argv
    assert sglang_argv(_cfg(), 30000, python="/x/python")[0] == "/x/python"


def test_too_few_gpus_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot hold 3 SGLang server"):
        gpu_groups(["0", "1", "2", "3"], 2, 3)
    with pytest.raises(ValueError, match="cannot hold one"):
        gpu_groups([], 1, None)
    assert gpu_groups(["0", "1", "2"], 2, None) == [["0", "1"]]  # a leftover GPU stays idle


def test_without_a_gpu_one_server_runs_on_the_cpu_with_the_flags_that_work(monkeypatch):
    monkeypatch.setattr("launcher.sglang_servers.host_cores", lambda: 2)
    [spec] = sglang_specs(_cfg("engine.sglang.gpus=[]", "engine.sglang.enable_metrics=false"))
    assert list(spec.argv) == [
        *_common(30000),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--disable-overlap-schedule",
        "--max-total-tokens",
        "16384",
        "--dtype",
        "float32",
        "--mem-fraction-static",
        "0.6",
    ]
    # one thread on a small machine (2 threads on 2 shared cores decoded ~10x slower)
    assert spec.env == {
        "SGLANG_USE_CPU_ENGINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }
    two = sglang_specs(
        _cfg(
            "engine.sglang.gpus=[]",
            "engine.sglang.servers=2",
            "engine.dtype=bfloat16",
            "engine.torch_threads=3",
            "engine.sglang.max_total_tokens=4096",
            "engine.sglang.mem_fraction_static=0.5",
        )
    )
    assert [s.url for s in two] == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    argv = " ".join(two[1].argv)
    assert "--dtype bfloat16" in argv and "float32" not in argv
    assert "--max-total-tokens 4096" in argv and "--mem-fraction-static 0.5" in argv
    assert two[1].env["OMP_NUM_THREADS"] == "3"


def test_without_a_gpu_what_sglang_cannot_run_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="tp_size and dp_size must be 1") as refused:
        sglang_specs(_cfg("engine.sglang.gpus=[]", "engine.sglang.tp_size=2"))
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="cannot serve LoRA adapters on a CPU"):
        sglang_specs(_cfg("engine.sglang.gpus=[]", "trainer.lora.rank=8"))
    with pytest.raises(ValueError, match="does not exist"):
        check_sglang_python(_cfg(f"engine.sglang.python={tmp_path / 'nope'}"))
    if importlib.util.find_spec("sglang") is None:  # this interpreter: no sglang
        with pytest.raises(ValueError, match="set engine.sglang.python"):
            check_sglang_python(_cfg())
    check_sglang_python(_cfg(f"engine.sglang.python={sys.executable}"))


@pytest.mark.processes
def test_the_stand_in_kernel_refuses_an_sglang_it_was_not_written_for():
    """Imported beside another SGLang (here: none), the stand-in fails at once, naming
    the version it was written for."""
    import subprocess

    from support.sglang_cpu import STANDIN_KERNEL

    done = subprocess.run(
        [PY, "-c", "import sgl_kernel"],
        env={**os.environ, "PYTHONPATH": str(STANDIN_KERNEL)},
        capture_output=True,
        text=True,
    )
    from importlib import metadata

    try:
        installed = f"sglang=={metadata.version('sglang')}"
    except metadata.PackageNotFoundError:
        installed = "no sglang"
    if installed == "sglang==0.5.23":
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode != 0
        assert f"written for sglang==0.5.23; {installed} is installed" in done.stderr


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.processes
def test_supervisor_runs_local_engine_restarts_it_on_death_and_stops_it(tmp_path, tiny_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    spec = ServerSpec(
        "engine-0",
        tuple(
            cli_argv(
                "engine",
                "--model",
                str(tiny_model_dir),
                "--port",
                str(port),
                "--set",
                f"data_dir={tmp_path}",
                "--set",
                "engine.torch_threads=1",
            )
        ),
        url,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    sup = Supervisor(
        [spec], log_dir=tmp_path / "logs", ready_timeout_s=120, backoff_s=0.1, poll_s=0.1
    )
    sup.start()
    try:
        assert sup.urls == [url]
        wait_healthy([url], 5)  # attach to the running engine
        cfg = load_config(
            None,
            [f"data_dir={tmp_path}", "engine.backend=sglang", f"engine.sglang.attach=['{url}/']"],
        )
        with sglang_backends(cfg) as attached:
            assert attached.gateway.router.backends == [url]
        [first] = sup.pids()
        os.kill(first, signal.SIGKILL)  # a server dies
        assert _wait(lambda: sup.pids()[0] not in (None, first), 10), "not restarted"
        assert sup.restarts == [1] and sup.failed == []
        wait_healthy([url], 120)  # the restarted engine serves again
        second = sup.pids()[0]
    finally:
        sup.stop()
    assert not pid_alive(first) and not pid_alive(second)
    with pytest.raises(TimeoutError, match=url):
        wait_healthy([url], 0.5, interval_s=0.1)  # nothing is left answering
    assert (tmp_path / "logs" / "engine-0.log").stat().st_size > 0


_FLAKY = """
import http.server, pathlib, sys
marker = pathlib.Path(sys.argv[2])
if marker.exists():
    sys.exit(3)  # every restart dies at once
marker.touch()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.processes
def test_supervisor_gives_up_after_max_consecutive_deaths(tmp_path):
    port = free_port()
    spec = ServerSpec(
        "flaky",
        (PY, "-c", _FLAKY, str(port), str(tmp_path / "started")),
        f"http://127.0.0.1:{port}",
    )
    sup = Supervisor(
        [spec],
        log_dir=tmp_path,
        ready_timeout_s=30,
        backoff_s=0.05,
        max_backoff_s=0.2,
        max_restarts=2,
        poll_s=0.05,
    )
    sup.start()
    try:
        os.kill(sup.pids()[0], signal.SIGKILL)
        assert _wait(lambda: sup.failed == ["flaky"], 10)
        assert sup.restarts == [2] and sup.pids() == [None]
        with pytest.raises(RuntimeError, match="gave up restarting flaky"):
            sup.wait()
    finally:
        sup.stop()


@pytest.mark.processes
def test_start_failure_stops_the_servers_already_started(tmp_path):
    good_port = free_port()
    good = ServerSpec(
        "good",
        (PY, "-c", _FLAKY, str(good_port), str(tmp_path / "m")),
        f"http://127.0.0.1:{good_port}",
    )
    bad = ServerSpec(
        "bad", (PY, "-c", "import sys; sys.exit(7)"), f"http://127.0.0.1:{free_port()}"
    )
    sup = Supervisor([good, bad], log_dir=tmp_path, ready_timeout_s=30)
    with pytest.raises(RuntimeError, match="bad exited with code 7"):
        sup.start()
    assert all(pid is None or not pid_alive(pid) for pid in sup.pids())


_SUPERVISED = """
import os, signal, sys, time
from pathlib import Path
from launcher.sglang_servers import ServerSpec, Supervisor
port, marker, tmp = sys.argv[1], sys.argv[2], Path(sys.argv[3])
server = ("import http.server, sys\\n"
          "class H(http.server.BaseHTTPRequestHandler):\\n"
          "    def do_GET(self):\\n"
          "        self.send_response(200); self.end_headers()\\n"
          "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\\n")
spec = ServerSpec("s", (sys.executable, "-c", server, port), f"http://127.0.0.1:{port}")
sup = Supervisor([spec], log_dir=tmp, backoff_s=0.05, poll_s=0.05, ready_timeout_s=60)
sup.start()
first = sup.pids()[0]
os.kill(first, signal.SIGKILL)
deadline = time.monotonic() + 60
while sup.pids()[0] in (None, first):
    if time.monotonic() > deadline:
        sys.exit("not restarted within 60 s")
    time.sleep(0.05)
print(sup.pids()[0], flush=True)
time.sleep(600)
"""


@pytest.mark.processes
def test_a_restarted_server_dies_with_a_supervisor_killed_outright(tmp_path):
    """Restarts fork from the monitor thread; the child is still tied to the launcher's
    life (PR_SET_PDEATHSIG on that thread), so SIGKILL of the launcher leaves no server."""
    import subprocess

    proc = subprocess.Popen(
        [PY, "-c", _SUPERVISED, str(free_port()), "m", str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # Bounded: a launcher that never prints (stuck starting or restarting) fails the
        # test instead of hanging the run.
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the supervising launcher printed no restarted pid within 120 s"
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"launcher exited {proc.poll()} without a pid: {line!r}"
        restarted = int(line)
        assert pid_alive(restarted)
    finally:
        proc.kill()
        proc.wait()
    assert _wait(lambda: not pid_alive(restarted), 10), "restarted server outlived its launcher"
