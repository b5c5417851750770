"""SGLang servers as engines: the `sglang.launch_server` command lines for a host's GPU
groups, a supervisor that starts them, waits for `/health_generate`, restarts one that
dies (with backoff) and stops them all, and attaching to servers already running.

One server per GPU group of `tp_size * dp_size` GPUs (`tp_size` with
`--enable-dp-attention` in `extra_args`: the dp replicas then share the tp GPUs), each
with its own CUDA_VISIBLE_DEVICES and port (`engine.port + i`). Several servers rather
than one big `--dp-size` server because the gateway routes between them itself (session
stickiness keeps a conversation's prefix cache on one server) and swaps weights on
each, and because SGLang refuses distributed weight sync (`init_weights_update_group`)
on a dp > 1 server without dp attention: such a server is swapped from disk only
(`sglang_protocol.weight_group_ranks`).

With `gateway.router.url` (a running `sglang-router`), the launched or attached servers
are also added to that router (`register_with_router`), and the gateway generates
through the router and swaps each worker it lists.

A restarted server loads the checkpoint it was launched with (`engine.model`, version
`engine.weight_version`); the gateway's backend pool (`gateway/routing.py`) keeps it out
of rotation while it fails health checks and re-syncs its weights to the last swap
before routing to it again. Only death is acted on, not a failing health check: a
paused server with nothing running can answer 503 during a weight swap, and killing it
then would turn a swap into a reload.

SGLang's flags used here (checked against `python/sglang/srt/server_args.py` of SGLang
0.5.x, the version the `[sglang]` extra pins): `--model-path`, `--served-model-name`,
`--weight-version`, `--host`, `--port`, `--tp-size`, `--dp-size`,
`--mem-fraction-static`, `--log-level`, `--enable-metrics`, `--context-length`,
`--max-running-requests`, `--dtype`, and with a LoRA default policy `--enable-lora`,
`--max-loras-per-batch`, `--max-lora-rank` and `--lora-target-modules` (the union of the
policies' modules). No `--lora-paths`: every policy's untrained version is the base
model itself (LoRA's B starts at zero), and the gateway loads each published version
at run time under a versioned name (`/load_lora_adapter`, `gateway/adapters.py`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from areal_service.config import ServerFleetConfig, ServiceConfig, with_gateway_section
from areal_service.cpu_share import host_cores
from areal_service.serving_plan import ServingPlan
from areal_service.sglang_protocol import ROUTER_ADD_WORKER, ROUTER_WORKERS, router_worker_urls
from launcher.processes import ChildProcess

log = logging.getLogger(__name__)

HEALTH_PATH = "/health_generate"
"""Answers 200 only after a real 1-token generation (SGLang and the local engine)."""


@dataclass(frozen=True)
class ServerSpec:
    """One server to keep running: its command, environment, and where it answers."""

    name: str
    argv: tuple[str, ...]
    url: str
    env: Mapping[str, str] = field(default_factory=dict)
    health_path: str = HEALTH_PATH
    """Answers 200 once the server can generate (vLLM: `/health`)."""


def visible_gpus(configured: Sequence[str] | None) -> list[str]:
    """The GPUs servers may use: the configured list, else CUDA_VISIBLE_DEVICES, else
    every device torch counts (0..n-1)."""
    if configured is not None:
        return [str(g) for g in configured]
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    import torch  # only here: the GPU count; `config show` and attach stay torch-free

    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_groups(gpus: Sequence[str], per_server: int, servers: int | None) -> list[list[str]]:
    """Consecutive groups of `per_server` GPUs, `servers` of them (None: as many as fit).
    Raises ValueError when the GPUs do not cover the groups asked for."""
    fit = len(gpus) // per_server
    count = fit if servers is None else servers
    if count < 1 or count > fit:
        raise ValueError(
            f"{len(gpus)} GPU(s) ({','.join(gpus) or 'none'}) cannot hold "
            f"{count if servers else 'one'} SGLang server(s) of {per_server} GPU(s) "
            "(engine.sglang.tp_size * dp_size); set engine.sglang.gpus or servers"
        )
    return [list(gpus[i * per_server : (i + 1) * per_server]) for i in range(count)]


def advertised_host(bind_host: str) -> str:
    """The host others reach a server bound to `bind_host` at (a wildcard bind is
    reached through this machine's name)."""
    return socket.gethostname() if bind_host in ("0.0.0.0", "::", "") else bind_host


def sglang_argv(
    config: ServiceConfig, port: int, *, python: str | None = None, on_cpu: bool = False
) -> list[str]:
    """`python -m sglang.launch_server ...` for one server of `config` on `port` (on the
    CPU with `on_cpu`: `sglang_cpu_flags`)."""
    engine, sg = config.engine, config.engine.sglang
    argv = [
        python or sg.python or sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(config.model_dir()),
        "--served-model-name",
        engine.served_model_name or str(config.model_dir()),
        "--weight-version",
        engine.weight_version,
        "--host",
        engine.host,
        "--port",
        str(port),
        "--tp-size",
        str(sg.tp_size),
        "--dp-size",
        str(sg.dp_size),
        "--log-level",
        config.log_level,
    ]
    if sg.max_running_requests is not None:
        argv += ["--max-running-requests", str(sg.max_running_requests)]
    if sg.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(sg.mem_fraction_static)]
    if engine.context_length is not None:
        argv += ["--context-length", str(engine.context_length)]
    if engine.dtype != "auto":
        argv += ["--dtype", engine.dtype]
    if sg.max_total_tokens is not None and not on_cpu:
        argv += ["--max-total-tokens", str(sg.max_total_tokens)]
    if on_cpu:
        argv += sglang_cpu_flags(config)
    if sg.enable_metrics:
        argv.append("--enable-metrics")
    flags = ServingPlan(config).engine
    if flags.lora:  # versioned adapters, loaded at run time
        argv += [
            "--enable-lora",
            "--max-loras-per-batch",
            str(flags.lora_slots),
            "--max-lora-rank",
            str(flags.max_lora_rank),
            "--lora-target-modules",
            *flags.target_modules,
        ]
    return argv + list(sg.extra_args)


def sglang_specs(config: ServiceConfig) -> list[ServerSpec]:
    """The servers `config` asks for on this host: one per GPU group, or (no GPU visible)
    `engine.sglang.servers` (default one) on the CPU."""
    sg = config.engine.sglang
    gpus = visible_gpus(sg.gpus)
    if not gpus:
        cpu_refusal = sglang_cpu_refusal(config)
        if cpu_refusal:
            raise ValueError(cpu_refusal)
    per_server = sg.tp_size if "--enable-dp-attention" in sg.extra_args else sg.tp_size * sg.dp_size
    groups: list[list[str] | None] = (
        list(gpu_groups(gpus, per_server, sg.servers)) if gpus else [None] * (sg.servers or 1)
    )
    host = advertised_host(config.engine.host)
    ports = [config.engine.port + i for i in range(len(groups))]
    if config.gateway.port in ports:
        raise ValueError(
            f"gateway.port {config.gateway.port} is among the SGLang servers' "
            f"ports {ports[0]}-{ports[-1]} (engine.port + i); change one"
        )
    return [
        ServerSpec(
            name=f"sglang-{i}",
            argv=tuple(sglang_argv(config, port, on_cpu=group is None)),
            url=f"http://{host}:{port}",
            env=(
                {"CUDA_VISIBLE_DEVICES": ",".join(group)}
                if group is not None
                else sglang_cpu_env(config, len(groups))
            ),
        )
        for i, (group, port) in enumerate(zip(groups, ports, strict=True))
    ]


def check_engine_python(python: str | None, module: str, name: str, hint: str) -> None:
    """ValueError, in one line saying what to set, unless the configured interpreter
    (`engine.<module>.python`) exists or, with none configured, this one can import
    `module`. SGLang and vLLM pin their own torch, so they usually live in a venv of
    their own."""
    setting = f"engine.{module}.python"
    if python is None:
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"engine.backend is {module} but this interpreter has no {module}: set "
                f"{setting} to one that has it ({name} pins its own torch, so it usually "
                f"lives in a venv of its own; {hint})"
            )
    elif not shutil.which(python) and not Path(python).is_file():
        raise ValueError(f"{setting} {python!r} does not exist")


def check_sglang_python(config: ServiceConfig) -> None:
    """`check_engine_python` for SGLang."""
    check_engine_python(
        config.engine.sglang.python,
        "sglang",
        "SGLang",
        "on a CPU: scripts/build_sglang_venv.sh, see docs/scale-out.md",
    )


def sglang_cpu_refusal(config: ServiceConfig) -> str | None:
    """Why SGLang cannot run `config` on this machine's CPU (no GPU visible), in one line;
    None when it can (measured with SGLang 0.5.23's CPU engine and torch-native
    attention)."""
    sg = config.engine.sglang
    if sg.tp_size * sg.dp_size > 1:
        return (
            "SGLang without a GPU runs one CPU process per server: engine.sglang.tp_size "
            f"and dp_size must be 1 (got {sg.tp_size} and {sg.dp_size}); no GPU is visible "
            "(engine.sglang.gpus, CUDA_VISIBLE_DEVICES, torch)"
        )
    if ServingPlan(config).engine.lora:
        return (
            "SGLang 0.5.23 cannot serve LoRA adapters on a CPU (its LoRA layers allocate "
            "pinned memory at start: 'pin_memory=True requires a CUDA or other accelerator "
            "backend'): use the local engine or vLLM for default_policy.lora without a GPU"
        )
    return None


CPU_MAX_TOTAL_TOKENS = 16384
"""`--max-total-tokens` on a CPU (~0.7 GB of fp32 KV cache for a 135M model): bounded,
since SGLang sizes the cache from the whole machine's available memory there."""
CPU_MEM_FRACTION_STATIC = 0.6
"""`--mem-fraction-static` on a CPU unless configured (0.1 once failed with "no GPU
memory for the KV cache": the fraction is of the machine's available memory)."""


def sglang_cpu_flags(config: ServiceConfig) -> list[str]:
    """The flags SGLang 0.5.23 needs to serve on a CPU without AMX: the CPU device,
    torch-native attention (the default CPU backend needs AMX kernels), no overlap
    scheduler, fp32 unless `engine.dtype` says otherwise (SGLang picks float16 for an
    fp32 checkpoint on a CPU: slower, logprobs off the trainer's by ~6e-3), and a bounded
    KV cache."""
    sg = config.engine.sglang
    flags = [
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--disable-overlap-schedule",
        "--max-total-tokens",
        str(sg.max_total_tokens or CPU_MAX_TOTAL_TOKENS),
    ]
    if config.engine.dtype == "auto":
        flags += ["--dtype", "float32"]
    if sg.mem_fraction_static is None:
        flags += ["--mem-fraction-static", str(CPU_MEM_FRACTION_STATIC)]
    return flags


def sglang_cpu_env(config: ServiceConfig, servers: int) -> dict[str, str]:
    """The environment of a CPU server: SGLang's CPU engine, no GPU, and its intra-op
    threads (`engine.torch_threads`, else the cores split between the servers and what
    shares them: on 2 shared cores one thread decoded 8-12 tok/s, two 0.7-1.4)."""
    threads = config.engine.torch_threads or max(1, host_cores() // (2 * servers))
    env = {
        "SGLANG_USE_CPU_ENGINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": str(threads),
    }
    if config.model_dir().is_dir():  # a local checkpoint: never reach for the Hub
        env["HF_HUB_OFFLINE"] = "1"
    return env


def wait_healthy(
    urls: Sequence[str], timeout_s: float, *, interval_s: float = 1.0, path: str = HEALTH_PATH
) -> None:
    """Block until every URL answers 200 on `path` (attach), or raise TimeoutError naming
    those that did not."""
    deadline = time.monotonic() + timeout_s
    pending = [u.rstrip("/") for u in urls]
    while pending:
        still = []
        for url in pending:
            try:
                ok = httpx.get(url + path, timeout=30.0).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                still.append(url)
        pending = still
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"not healthy after {timeout_s:.0f} s: {', '.join(pending)}")
        if pending:
            time.sleep(interval_s)


_PDEATHSIG_EXEC = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"  # PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"  # the launcher died before the prctl: nobody would stop us
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def tied_to_this_thread(argv: Sequence[str]) -> list[str]:
    """`argv` behind a small exec shim that asks Linux for SIGTERM when the thread that
    starts it ends (the signal survives exec). Restarts are started by the monitor
    thread, where ChildProcess sets no pre-exec hook (running Python between fork and
    exec is unsafe with other threads about, and crashed children here); the monitor
    outlives every child it starts (stop() ends it, then stops them), so a launcher
    killed outright takes restarted servers along. Costs one interpreter start."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-c", _PDEATHSIG_EXEC, str(os.getpid()), *argv]


class _Server:
    """A supervised server: the running child and its restart bookkeeping."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.child: ChildProcess | None = None
        self.started_at = 0.0
        self.deaths = 0  # consecutive, reset once it stayed up ready_timeout_s
        self.restarts = 0  # total, for the log and tests
        self.restart_at: float | None = None
        self.failed = False


class Supervisor:
    """Keeps a set of servers running until `stop()`.

    `start()` launches all and waits until each answers `/health_generate` (in
    parallel: SGLang startup is minutes of weight loading per server). A monitor thread
    then polls the children every `poll_s`; one that exited is restarted after
    `backoff_s * 2**(deaths-1)` (capped), where deaths counts consecutive deaths of
    servers that had not stayed up `ready_timeout_s`. After `max_restarts` such deaths
    the server is left down and `failed` says so. `stop()` stops the monitor first, then
    every child (SIGTERM, grace, SIGKILL of its process group)."""

    def __init__(
        self,
        specs: Sequence[ServerSpec],
        *,
        log_dir: Path,
        ready_timeout_s: float = 900.0,
        backoff_s: float = 5.0,
        max_backoff_s: float = 300.0,
        max_restarts: int = 10,
        poll_s: float = 0.5,
    ) -> None:
        self._servers = [_Server(s) for s in specs]
        self._log_dir = log_dir
        self._ready_timeout_s = ready_timeout_s
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._max_restarts = max_restarts
        self._poll_s = poll_s
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # children are replaced by the monitor, read by others
        self._monitor: threading.Thread | None = None

    @classmethod
    def for_config(
        cls,
        config: ServiceConfig,
        specs: Sequence[ServerSpec] | None = None,
        fleet: ServerFleetConfig | None = None,
    ) -> Supervisor:
        """A supervisor with the timings of `fleet` (default `config.engine.sglang`),
        logging to `<data_dir>/logs/<name>.log`; `specs` default to
        `sglang_specs(config)`."""
        sg = fleet or config.engine.sglang
        return cls(
            sglang_specs(config) if specs is None else specs,
            log_dir=config.data_dir / "logs",
            ready_timeout_s=sg.ready_timeout_s,
            backoff_s=sg.restart_backoff_s,
            max_backoff_s=sg.max_restart_backoff_s,
            max_restarts=sg.max_restarts,
        )

    @property
    def urls(self) -> list[str]:
        """Base URLs of the servers, in spec order (what `gateway.router.backends` gets)."""
        return [s.spec.url for s in self._servers]

    @property
    def restarts(self) -> list[int]:
        """Restarts so far, per server."""
        return [s.restarts for s in self._servers]

    @property
    def failed(self) -> list[str]:
        """Names of servers given up on (too many consecutive deaths)."""
        return [s.spec.name for s in self._servers if s.failed]

    def pids(self) -> list[int | None]:
        """Process ids of the current children (None while one awaits its restart)."""
        with self._lock:
            return [s.child.proc.pid if s.child else None for s in self._servers]

    def start(self) -> None:
        """Launch every server, wait until all are healthy, then start the monitor.
        On any failure every server started so far is stopped and the error raised."""
        self._log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for server in self._servers:
                self._launch(server)
            with ThreadPoolExecutor(len(self._servers)) as pool:
                for fut in [pool.submit(self._wait_ready, s) for s in self._servers]:
                    fut.result()
        except BaseException:
            self.stop()
            raise
        self._monitor = threading.Thread(target=self._watch, name="sglang-supervisor", daemon=True)
        self._monitor.start()

    def stop(self) -> None:
        """Stop the monitor, then every server (newest first)."""
        self._stopping.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join()
        with self._lock:
            for server in reversed(self._servers):
                if server.child is not None:
                    server.child.stop()
                    _kill_group(server.child.proc.pid)

    def __enter__(self) -> Supervisor:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def wait(self) -> None:
        """Block until `stop()` or until a server is given up on (then raise)."""
        while not self._stopping.wait(1.0):
            if self.failed:
                raise RuntimeError(f"gave up restarting {', '.join(self.failed)}")

    # --- internals --------------------------------------------------------------------

    def _launch(self, server: _Server) -> None:
        spec = server.spec
        child = ChildProcess(
            spec.name,
            tied_to_this_thread(spec.argv),
            env=dict(spec.env),
            log_path=self._log_dir / f"{spec.name}.log",
        )
        with self._lock:
            server.child = child
            server.started_at = time.monotonic()
            server.restart_at = None

    def _wait_ready(self, server: _Server) -> None:
        assert server.child is not None
        server.child.wait_http_ok(server.spec.url + server.spec.health_path, self._ready_timeout_s)
        log.info("%s healthy at %s", server.spec.name, server.spec.url)

    def _watch(self) -> None:
        while not self._stopping.wait(self._poll_s):
            for server in self._servers:
                self._check(server)

    def _check(self, server: _Server) -> None:
        now = time.monotonic()
        child = server.child
        if server.failed:
            return
        if child is not None:
            code = child.proc.poll()
            if code is None:
                if now - server.started_at >= self._ready_timeout_s:
                    server.deaths = 0  # stayed up: the next death starts a fresh backoff
                return
            child.stop()  # closes its log
            _kill_group(child.proc.pid)  # SGLang's scheduler/detokenizer may outlive it
            server.deaths += 1
            if server.deaths > self._max_restarts:
                server.failed = True
                log.error(
                    "%s exited (code %s) %d times in a row; not restarting",
                    server.spec.name,
                    code,
                    server.deaths,
                )
                with self._lock:
                    server.child = None
                return
            delay = min(self._backoff_s * 2 ** (server.deaths - 1), self._max_backoff_s)
            log.warning("%s exited (code %s); restarting in %.1f s", server.spec.name, code, delay)
            with self._lock:
                server.child = None
                server.restart_at = now + delay
            return
        if server.restart_at is not None and now >= server.restart_at:
            server.restarts += 1
            self._launch(server)
            # Not waited on here: the gateway's health checks keep it out of rotation
            # until it answers and holds the current weights.


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of a dead server's process group (its GPU memory and port
    are held until the last member is gone). The group id cannot be reused while any
    member lives, so this reaches only our leftovers."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def register_with_router(router_url: str, urls: Sequence[str], *, timeout_s: float = 60.0) -> None:
    """Add `urls` to a running SGLang router (`gateway.router.url`) and wait until it
    lists them all: `POST /workers {"url"}` (queued, idempotent), `POST /add_worker?url=`
    on older routers. TimeoutError naming those it never listed."""
    base = router_url.rstrip("/")
    wanted = [u.rstrip("/") for u in urls]
    with httpx.Client(base_url=base, timeout=30.0) as http:
        for url in wanted:
            r = http.post(ROUTER_ADD_WORKER.path, json={"url": url})
            if r.status_code == 404 and ROUTER_ADD_WORKER.legacy_path:
                r = http.post(ROUTER_ADD_WORKER.legacy_path, params={"url": url})
            if r.status_code >= 400:
                raise RuntimeError(
                    f"router {base} refused worker {url}: {r.status_code} {r.text[:500]}"
                )
        deadline = time.monotonic() + timeout_s
        while True:
            r = http.get(ROUTER_WORKERS.path)
            if r.status_code == 404 and ROUTER_WORKERS.legacy_path:
                r = http.get(ROUTER_WORKERS.legacy_path)
            listed = set(router_worker_urls(r.json())) if r.status_code == 200 else set()
            missing = [u for u in wanted if u not in listed]
            if not missing:
                log.info("router %s routes to %s", base, " ".join(wanted))
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"router {base} did not list {', '.join(missing)} after {timeout_s:.0f} s"
                )
            time.sleep(0.2)


@contextmanager
def sglang_backends(config: ServiceConfig) -> Iterator[ServiceConfig]:
    """`config` with `gateway.router.backends` set to the SGLang servers, launched and
    supervised for the block (or attached: health-checked, left running after). With
    `gateway.router.url`, the servers are also added to that router (the gateway then
    generates through it and swaps each worker it lists)."""
    sg = config.engine.sglang
    if sg.attach:
        wait_healthy(sg.attach, sg.ready_timeout_s)
        urls = [u.rstrip("/") for u in sg.attach]
        if config.gateway.router.url:
            register_with_router(config.gateway.router.url, urls)
        yield with_gateway_section(config, "router", backends=urls)
        return
    check_sglang_python(config)
    with Supervisor.for_config(config) as sup:
        if config.gateway.router.url:
            register_with_router(config.gateway.router.url, sup.urls)
        yield with_gateway_section(config, "router", backends=sup.urls)


def run_sglang_engines(config: ServiceConfig) -> None:
    """`areal-service engine --backend sglang`: launch (or attach to) the servers, log
    their URLs, and supervise them until Ctrl-C / SIGTERM."""
    sg = config.engine.sglang
    if sg.attach:
        wait_healthy(sg.attach, sg.ready_timeout_s)
        log.info("SGLang servers healthy (attached): %s", " ".join(sg.attach))
        if config.gateway.router.url:
            register_with_router(config.gateway.router.url, sg.attach)
        return
    check_sglang_python(config)
    with Supervisor.for_config(config) as sup:
        log.info("SGLang servers healthy: %s (gateway.router.backends)", " ".join(sup.urls))
        if config.gateway.router.url:
            register_with_router(config.gateway.router.url, sup.urls)
        sup.wait()
