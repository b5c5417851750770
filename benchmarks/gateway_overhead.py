"""The gateway's own cost: the same load sent straight to an SGLang-protocol backend and
through the gateway, in one run, printed next to the targets.

The backend is the echo backend (`engine/echo_backend.py`, a child process): it does
no model work, so what the gateway adds is all that differs between the paths. Load: C
concurrent closed-loop aiohttp clients (this process) send the same requests, not
streaming and streaming, (a) as token ids to the backend's `/generate`, (b) as a short
chat to the gateway's `/v1/chat/completions` (max_tokens 32) with capture ON (SQLite
WAL, durable group commit before the reply), (c) the same with `gateway.capture=false`.
Each gateway is a child process (`python -m benchmarks.gateway_overhead serve --set
...` = `run_gateway(load_config(overrides))`), so none shares the load's event loop.
Settings: a fast backend (prefill + 32 x token delay = tens of ms), a typical LLM one
(~10 ms a token), zero delay (the gateway's CPU cost dominates); the echo backend is
restarted on the same port between settings, the two gateways stay up. Reported: req/s,
p50/p99, streaming TTFT p50 (direct: first SSE chunk; gateway: first content chunk),
gateway CPU ms per request (/proc, all threads, and its event-loop thread), RSS.

Presets `--preset stream-pace|zero-delay [--baseline REF] [--rounds 3] [--workers
default,1,2]` (~1 min per gateway): stream-pace's backend takes 20 ms to the first token,
then 5 ms a token; zero-delay's answers at once, so the gateway's own CPU decides
throughput (the setting that shows a hot-path regression). 32 tokens, 64 clients,
capture on: direct / this gateway (the config's default worker count, what users get) /
the gateway of REF, a source tree or a commit (`git worktree add`ed for the run and
removed after; `file`: the commit named in `benchmarks/baseline-commit`) / per
`--workers` value, this gateway with that many processes; measured in the same rounds in
rotating order, medians of the rounds. Prints req/s, p50/p99, TTFT p50, the ratios
against direct, gateway CPU per request (and its kernel part) and per streamed token
((stream - non-stream) / 32), beside a byte relay's (`benchmarks/tcp_relay.py`: the
floor of forwarding each token in Python), then this tree against the baseline: req/s
and CPU ratios, and a WARNING line when a CPU cost rose more than 15%. `--quick` (CI):
zero-delay, three rounds of 500 requests per path. `--stream-interval N`: the backend sends
a chunk every N tokens (SGLang's `--stream-interval`), what moves the per-token cost
below the relay's floor.

Run: `python -m benchmarks.gateway_overhead [--requests 1500] [--stream-requests 600]
[--concurrency 64] [--delay-ms 5] [--token-delay-ms 2] [--slow-token-delay-ms 10]
[--no-zero-delay] [--session-mode episode|key|admin] [--profile DIR [--profiler
cprofile|yappi]]`. External profiling: `py-spy record --pid <gateway> --gil`
(not a dependency), then `python -m benchmarks.gateway_overhead summarize FILE` on its
`--format raw` output.

The echo backend emits ids up to ~30100; the tiny model's vocab has 652, so decoding
its output would give empty text (and no streamed content). The benchmark therefore
serves a 32k-vocab byte-level BPE trained here on random words, with the project's chat
template: real decode and template costs, realistic text length per token.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import cProfile
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from engine.echo_backend import start_echo_backend

ADMIN_KEY = "sk-bench-admin"
MODEL = "areal-policy"
CHAT = [
    {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
    {"role": "user", "content": "What is the capital of France, and why is it famous?"},
]
MAX_TOKENS = 32
VOCAB = 32768
REPO = Path(__file__).resolve().parents[1]

SESSION_MODES = {
    "episode": "one session key per RL episode (POST /rl/sessions)",
    "key": "one user key, auto session (one ever-growing session)",
    "admin": "admin key, no session",
}
TARGETS = {
    "throughput": "capture-on req/s >= 0.8x direct",
    "p50": "added p50 <= 3 ms",
    "p99": "added p99 <= 20 ms",
    "ttft": "stream TTFT p50 within 2 ms of direct",
    "rss": "gateway RSS <= 400 MB",
}


# ------------------------------------------------------------------ tokenizer
def build_bench_tokenizer(out: Path) -> Path:
    """A 32k byte-level BPE (random-word corpus, ChatML template), cached in `out`."""
    if (out / "tokenizer.json").exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AddedToken, PreTrainedTokenizerFast

    from engine.tiny_model import MARKER_TOKENS, SPECIAL_TOKENS, chat_template

    rng = random.Random(0)
    words = [
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(40_000)
    ]
    corpus = (" ".join(rng.choices(words, k=12)) + "." for _ in range(60_000))
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=VOCAB - len(MARKER_TOKENS),
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    tok.chat_template = chat_template()
    tmp = Path(tempfile.mkdtemp(prefix=".tok.", dir=out.parent))
    tok.save_pretrained(tmp)
    (tmp / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    tmp.rename(out)
    return out


def prompt_ids(tokenizer_dir: Path) -> list[int]:
    """The ids the gateway renders for `CHAT` (so both paths send the same prompt)."""
    from gateway.tokenizer import ChatTokenizer
    from gateway.translate import render_prompt_ids

    return render_prompt_ids(ChatTokenizer.from_pretrained(tokenizer_dir), CHAT, None, None)


# ------------------------------------------------------------------ processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of `pid` in MB, from /proc/<pid>/status."""
    fields = dict(
        line.split(":", 1)
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if ":" in line
    )
    return (int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024)


def cpu_s(pid: int, tid: int | None = None, *, kernel_only: bool = False) -> float:
    """User + system CPU seconds of process `pid` (all threads), or of its thread `tid`;
    `kernel_only`: the system part alone (syscalls: socket reads and writes)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    stat = Path(path).read_text().rsplit(")", 1)[1].split()
    ticks = int(stat[12]) if kernel_only else int(stat[11]) + int(stat[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int, *, kernel_only: bool = False) -> float:
    """`cpu_s` of `pid` and every process below it (the workers of a multi-worker
    gateway are children of uvicorn's supervisor)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_s(p, kernel_only=kernel_only)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):  # a process that just ended
            continue
    return total


def nested_gateway_config(repo: Path) -> bool:
    """Whether the source tree `repo` has the nested gateway sections (`gateway.router`,
    `gateway.auth`, ...) rather than the flat keys of older commits."""
    config = repo / "areal_service" / "config"  # a package since the config split
    sources = config.glob("*.py") if config.is_dir() else [config.with_suffix(".py")]
    return any("class RouterConfig" in source.read_text() for source in sources)


@dataclass
class Gateway:
    """A gateway child process started by this benchmark (stopped by handle)."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    keys: list[str] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        name: str,
        *,
        backend: str,
        tokenizer: Path,
        data_dir: Path,
        capture: bool,
        profile: Path | None = None,
        profiler: str = "cprofile",
        repo: Path = REPO,
        workers: int | None = None,
    ) -> Gateway:
        """Start `serve` from the source tree `repo` (another checkout for A/B runs) with
        `workers` gateway processes (None: the config's default, what users get)."""
        port = free_port()
        data_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "benchmarks.gateway_overhead", "serve"]
        if profile is not None:
            argv += ["--profile", str(profile), "--profiler", profiler]
        # A tree from before the gateway's settings were nested (286a9fe, the issue's
        # baseline) refuses the nested keys: it gets the flat ones it knows.
        flat = not nested_gateway_config(repo)
        router, auth, scale = (
            ("gateway", "gateway", "gateway")
            if flat
            else ("gateway.router", "gateway.auth", "gateway.scale")
        )
        for item in (
            f"data_dir={data_dir}",
            f"engine.model={tokenizer}",
            f"{router}.backends=[{backend}]",
            f"gateway.port={port}",
            f"gateway.capture={str(capture).lower()}",
            "log_level=warning",
            f"{auth}.admin_key={ADMIN_KEY}",
        ):
            argv += ["--set", item]
        if workers is not None:
            argv += ["--set", f"{scale}.workers={workers}"]
        log = data_dir / "gateway.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, cwd=repo, stdout=out, stderr=subprocess.STDOUT)
        return cls(name, f"http://127.0.0.1:{port}", proc, log)

    async def ready(self, session: aiohttp.ClientSession, timeout_s: float = 90.0) -> None:
        """Wait until the gateway answers readiness."""
        end = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(self.url + "/health/readiness") as r:
                    if r.status == 200:
                        return
            if time.monotonic() > end:
                raise TimeoutError(f"{self.name} not ready after {timeout_s} s")
            await asyncio.sleep(0.2)

    async def make_keys(self, session: aiohttp.ClientSession, mode: str, count: int) -> list[str]:
        """The bearer tokens the load uses: `episode`: `count` session keys (one RL
        episode each, `POST /rl/sessions`); `key`: one user key (auto session: every
        request lands in one ever-growing session); `admin`: the admin key (no session)."""
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        if mode == "admin":
            return [ADMIN_KEY]
        if mode == "key":
            async with session.post(
                self.url + "/admin/keys", json={"name": "bench"}, headers=admin
            ) as r:
                r.raise_for_status()
                return [(await r.json())["api_key"]]
        keys: list[str] = []
        while len(keys) < count:
            size = min(1024, count - len(keys))
            async with session.post(
                self.url + "/rl/sessions", json={"group_size": size}, headers=admin
            ) as r:
                r.raise_for_status()
                keys += [s["api_key"] for s in (await r.json())["sessions"]]
        return keys

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # uvicorn drains; the writer flushes
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# ------------------------------------------------------------------ load
@dataclass
class Result:
    """One load run: sorted latencies and TTFTs (seconds) and the wall time."""

    label: str
    wall_s: float
    latencies: list[float]
    ttfts: list[float] = field(default_factory=list)
    cpu_ms: float | None = None
    """CPU ms per request of the measured process (the gateway), None for direct."""
    loop_cpu_ms: float | None = None
    """The part of `cpu_ms` spent on the gateway's main thread (its event loop)."""
    sys_cpu_ms: float | None = None
    """The part of `cpu_ms` spent in the kernel (all threads)."""
    reads: float = 0.0
    """Network reads per streamed request at the client (~ the server's writes)."""

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall_s

    def pct(self, q: float, values: Sequence[float] | None = None) -> float:
        """The q-quantile in ms (nearest rank)."""
        v = self.latencies if values is None else values
        return 1000 * v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


Send = Callable[[aiohttp.ClientSession, int, str], Awaitable[float | None]]
"""Send request i with bearer token `key`; return its TTFT in seconds (streaming) or None."""


reads = [0]
"""Network reads of streamed bodies by the load (about the writes the server made)."""


def direct_sender(url: str, ids: list[int], stream: bool) -> Send:
    sampling = {"max_new_tokens": MAX_TOKENS, "temperature": 1.0, "top_p": 1.0, "top_k": -1}

    async def send(session: aiohttp.ClientSession, i: int, key: str) -> float | None:
        body = {
            "input_ids": ids,
            "sampling_params": sampling,
            "rid": f"bench-{i:09d}",
            "return_logprob": True,
            "stream": stream,
        }
        t0 = time.perf_counter()
        async with session.post(url + "/generate", json=body) as r:
            assert r.status == 200, r.status
            if not stream:
                assert len((await r.json())["output_ids"]) == MAX_TOKENS
                return None
            ttft, tail = None, b""
            async for piece in r.content.iter_any():
                reads[0] += 1
                if ttft is None and b"data:" in piece:
                    ttft = time.perf_counter() - t0
                tail = (tail + piece)[-32:]
            assert tail.endswith(b"data: [DONE]\n\n")
            return ttft

    return send


def _first_content(buf: bytes) -> bool:
    """True once `buf` holds a chat chunk with non-empty `delta.content`."""
    for line in buf.split(b"\n"):
        if line.startswith(b"data: {") and b'"content"' in line:
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0]["delta"].get("content"):
                return True
    return False


def gateway_sender(url: str, stream: bool) -> Send:
    body = json.dumps(
        {"model": MODEL, "messages": CHAT, "max_tokens": MAX_TOKENS, "stream": stream}
    ).encode()

    async def send(session: aiohttp.ClientSession, i: int, key: str) -> float | None:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        t0 = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
            assert r.status == 200, (r.status, await r.text())
            if not stream:
                assert (await r.json())["usage"]["completion_tokens"] == MAX_TOKENS
                return None
            ttft, buf, tail = None, b"", b""
            async for piece in r.content.iter_any():
                reads[0] += 1
                if ttft is None:
                    buf += piece
                    if _first_content(buf):
                        ttft = time.perf_counter() - t0
                tail = (tail + piece)[-32:]
            assert tail.endswith(b"data: [DONE]\n\n") and ttft is not None
            return ttft

    return send


async def drive(
    label: str,
    send: Send,
    n: int,
    concurrency: int,
    warmup: int,
    keys: Iterator[str],
    turns: int,
    pid: int | None = None,
) -> Result:
    """`concurrency` closed-loop clients send `warmup` unmeasured requests, then `n`. Each
    client sends `turns` requests in a row with one key, then takes the next key."""
    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=30)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        latencies: list[float] = []
        ttfts: list[float] = []

        async def client(requests: Iterator[int], measure: bool) -> None:
            key, turn = "", 0
            for i in requests:
                if turn == 0:
                    key = next(keys)
                turn = (turn + 1) % turns
                t0 = time.perf_counter()
                ttft = await send(session, i, key)
                if measure:
                    latencies.append(time.perf_counter() - t0)
                    if ttft is not None:
                        ttfts.append(ttft)

        requests = iter(range(warmup))
        await asyncio.gather(*(client(requests, False) for _ in range(concurrency)))
        requests = iter(range(warmup, warmup + n))

        def sample() -> tuple[float, float, float]:
            return (
                (tree_cpu_s(pid), cpu_s(pid, pid), tree_cpu_s(pid, kernel_only=True))
                if pid
                else (0.0, 0.0, 0.0)
            )

        cpu0 = sample()
        reads0 = reads[0]
        t0 = time.perf_counter()
        await asyncio.gather(*(client(requests, True) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        cpu = (
            tuple(1000 * (b - a) / n for a, b in zip(cpu0, sample(), strict=True))
            if pid
            else (None, None, None)
        )
    return Result(
        label, wall, sorted(latencies), sorted(ttfts), *cpu, reads=(reads[0] - reads0) / n
    )


# ------------------------------------------------------------------ report
def _ok(flag: bool) -> str:
    return "MET" if flag else "MISSED"


def report(
    setting: str, results: dict[str, Result], rss: dict[str, tuple[float, float]]
) -> list[str]:
    out = [
        f"\n== backend: {setting}",
        f"{'path':34} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'TTFT p50':>9} "
        f"{'gateway CPU ms/req':>19}",
    ]
    for r in results.values():
        ttft = f"{r.pct(0.5, r.ttfts):9.2f}" if r.ttfts else f"{'':9}"
        cpu = f"{r.cpu_ms:19.2f}" if r.cpu_ms is not None else ""
        out.append(f"{r.label:34} {r.rps:7.0f} {r.pct(0.5):8.2f} {r.pct(0.99):8.2f} {ttft} {cpu}")
    for mode in ("non-stream", "stream"):
        direct = results[f"direct {mode}"]
        for cap in ("capture on", "capture off"):
            gw = results[f"gateway {cap} {mode}"]
            ratio = gw.rps / direct.rps
            d50, d99 = gw.pct(0.5) - direct.pct(0.5), gw.pct(0.99) - direct.pct(0.99)
            line = (
                f"  {mode:10} {cap:11}: throughput {ratio:4.2f}x "
                f"[{TARGETS['throughput']}: {_ok(ratio >= 0.8) if cap == 'capture on' else '-'}]"
                f"  added p50 {d50:+6.2f} ms [{_ok(d50 <= 3)}]"
                f"  added p99 {d99:+6.2f} ms [{_ok(d99 <= 20)}]"
            )
            if mode == "stream":
                dt = gw.pct(0.5, gw.ttfts) - direct.pct(0.5, direct.ttfts)
                line += f"  TTFT {dt:+6.2f} ms [{_ok(dt <= 2)}]"
            out.append(line)
    for name, (now, peak) in rss.items():
        out.append(
            f"  RSS {name}: {now:.0f} MB now, {peak:.0f} MB peak "
            f"[{TARGETS['rss']}: {_ok(peak <= 400)}]"
        )
    return out


# ------------------------------------------------------------------ orchestration
@dataclass(frozen=True)
class Setting:
    """One echo-backend delay setting and the request counts run against it."""

    name: str
    delay_ms: float
    token_delay_ms: float
    requests: int
    stream_requests: int

    def describe(self) -> str:
        per_request = self.delay_ms + MAX_TOKENS * self.token_delay_ms
        return (
            f"echo backend --delay-ms {self.delay_ms:g} --token-delay-ms "
            f"{self.token_delay_ms:g} (~{per_request:.0f} ms of sleep per request; "
            f"{self.name})"
        )


async def until_served(
    gateways: Sequence[Gateway], session: aiohttp.ClientSession, timeout_s: float = 20.0
) -> None:
    """After a backend restart: wait until each gateway completes a chat again (its pool
    drops the dead connections, its health check re-admits the backend)."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
    end = time.monotonic() + timeout_s
    for gw in gateways:
        while True:
            headers = {"Authorization": f"Bearer {gw.keys[0]}"}
            async with session.post(
                gw.url + "/v1/chat/completions", json=body, headers=headers
            ) as r:
                if r.status == 200:
                    break
            if time.monotonic() > end:
                raise TimeoutError(f"{gw.name}: backend not served after restart")
            await asyncio.sleep(0.2)


async def run_setting(
    s: Setting,
    backend_url: str,
    gateways: dict[str, Gateway],
    ids: list[int],
    args: argparse.Namespace,
) -> list[str]:
    results: dict[str, Result] = {}
    keys = {cap: itertools.cycle(gw.keys) for cap, gw in gateways.items()}
    for mode, n in (("non-stream", s.requests), ("stream", s.stream_requests)):
        stream = mode == "stream"
        runs = [
            (f"direct {mode}", direct_sender(backend_url, ids, stream), itertools.repeat(""), None)
        ]
        for cap, gw in gateways.items():
            runs.append(
                (f"gateway {cap} {mode}", gateway_sender(gw.url, stream), keys[cap], gw.proc.pid)
            )
        for label, send, run_keys, pid in runs:
            r = await drive(
                label, send, n, args.concurrency, args.warmup, run_keys, args.turns, pid
            )
            results[label] = r
            cpu = (
                f", gateway CPU {r.cpu_ms:.2f} ms/req ({r.loop_cpu_ms:.2f} event loop)"
                if r.cpu_ms is not None
                else ""
            )
            print(f"  ran {label:34} {r.rps:7.0f} req/s p50 {r.pct(0.5):7.2f} ms{cpu}", flush=True)
    rss = {cap: rss_mb(gw.proc.pid) for cap, gw in gateways.items()}
    return report(s.describe(), results, rss)


def settings_of(args: argparse.Namespace) -> list[Setting]:
    settings = [
        Setting(
            "realistic: a fast backend",
            args.delay_ms,
            args.token_delay_ms,
            args.requests,
            args.stream_requests,
        )
    ]
    if args.slow_token_delay_ms > 0:
        settings.append(
            Setting(
                "a typical LLM backend under load",
                args.delay_ms,
                args.slow_token_delay_ms,
                args.requests // 2,
                args.stream_requests // 2,
            )
        )
    if not args.no_zero_delay:
        settings.append(
            Setting(
                "zero delay: the gateway's CPU cost dominates",
                0.0,
                0.0,
                args.requests,
                args.stream_requests,
            )
        )
    return settings


async def orchestrate(args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="areal-gw-bench-"))
    tokenizer = build_bench_tokenizer(Path(args.tokenizer_dir))
    ids = prompt_ids(tokenizer)
    settings = settings_of(args)
    first = settings[0]
    backend = start_echo_backend(
        subprocess_mode=True,
        tokens=MAX_TOKENS,
        delay_ms=first.delay_ms,
        token_delay_ms=first.token_delay_ms,
    )
    gateways: dict[str, Gateway] = {}
    try:
        for cap in ("capture on", "capture off"):
            slug = cap.replace(" ", "-")
            gateways[cap] = Gateway.start(
                cap,
                backend=backend.url,
                tokenizer=tokenizer,
                data_dir=work / slug,
                capture=cap == "capture on",
                profiler=args.profiler,
                profile=Path(args.profile) / f"gateway-{slug}.prof" if args.profile else None,
            )
        # Keys one run can take: a client starts a new episode every `turns` requests
        # and once per phase (warm-up, measured); spares are reused (itertools.cycle).
        episodes = sum(
            (2 * args.warmup + s.requests + s.stream_requests) // args.turns + 4 * args.concurrency
            for s in settings
        )
        t_setup = time.perf_counter()
        async with aiohttp.ClientSession() as session:
            for gw in gateways.values():
                await gw.ready(session)
                gw.keys = await gw.make_keys(session, args.session_mode, episodes)
                gw.proc.send_signal(signal.SIGUSR1)  # GC statistics from here on
        print(
            f"gateway overhead: {args.concurrency} concurrent closed-loop clients (aiohttp, "
            f"one process), each path measured after {args.warmup} warm-up requests; prompt {len(ids)} tokens, {MAX_TOKENS} output tokens; "
            f"{os.cpu_count()} CPUs shared with the backend, the load and whatever else runs."
            f"\nSessions: {SESSION_MODES[args.session_mode]}"
            f"{f' ({args.turns} requests each)' if args.session_mode == 'episode' else ''}."
            "\nThe backend is the echo backend (engine/echo_backend.py): no model work, "
            "so the difference between the paths is the gateway's own cost. Capture on = "
            "SQLite WAL, synchronous=NORMAL, group commit, durable before each reply."
            f"\n(set-up: gateways ready and {episodes} session keys each in "
            f"{time.perf_counter() - t_setup:.0f} s)",
            flush=True,
        )
        lines: list[str] = []
        async with aiohttp.ClientSession() as session:
            for k, s in enumerate(settings):
                if k:  # same port, new delays: the gateways keep their config
                    backend.stop()
                    backend = start_echo_backend(
                        backend.port,
                        subprocess_mode=True,
                        tokens=MAX_TOKENS,
                        delay_ms=s.delay_ms,
                        token_delay_ms=s.token_delay_ms,
                    )
                    await until_served(list(gateways.values()), session)
                print(f"-- {s.describe()}: {s.requests} + {s.stream_requests} requests", flush=True)
                lines += await run_setting(s, backend.url, gateways, ids, args)
        print("\n".join(lines))
        print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    finally:
        for gw in gateways.values():
            gw.stop()
        backend.stop()
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------ preset: stream pace
PACE = {"delay_ms": 20.0, "token_delay_ms": 5.0, "concurrency": 64, "rounds": 3, "requests": 400}
"""`--preset stream-pace`: issue 14's setting (20 ms to the first token, then 5 ms per
token, 32 tokens; 64 closed-loop clients; median of 3 rounds)."""
PRESETS = {
    "stream-pace": PACE,
    "zero-delay": {**PACE, "delay_ms": 0.0, "token_delay_ms": 0.0, "requests": 1000},
}
"""`--preset zero-delay`: the same machinery against a backend that answers at once, where
the gateway's own CPU decides throughput (the setting that shows a hot-path regression)."""
QUICK = {"requests": 500, "rounds": 3, "warmup": 64}
"""`--quick`: the CI form (~40 s; CPU columns are what it is for: a few hundred requests
measure CPU per request to a few percent on a quiet host, req/s much less well; the
median of three rounds keeps one disturbed round from raising a warning)."""
BASELINE_FILE = REPO / "benchmarks" / "baseline-commit"
"""The commit CI compares the gateway's CPU with (`--baseline file`); move it forward when a
cost is accepted on purpose, and say so in the commit."""
CPU_WARN = 0.15
"""CPU per request or per token above the baseline's by more than this prints a warning."""
PACE_TARGETS = {"stream": 0.9, "non-stream": 0.95, "ttft_ms": 10.0, "stream_p50_ms": 15.0}


def _median(values: Sequence[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2]


async def run_pace(args: argparse.Namespace) -> None:
    """Direct, this gateway and (with `--baseline DIR`, another source tree, e.g. a
    `git worktree` of an older commit) the baseline's gateway, measured in the same
    rounds, in rotating order, capture on. Per path the median over rounds of req/s,
    p50, TTFT p50 and gateway CPU; per streamed token the gateway CPU the stream adds
    over the same request not streamed ((stream - non-stream) / tokens)."""
    t_start = time.perf_counter()
    preset = PRESETS[args.preset]
    work = Path(tempfile.mkdtemp(prefix="areal-gw-pace-"))
    tokenizer = build_bench_tokenizer(Path(args.tokenizer_dir))
    ids = prompt_ids(tokenizer)
    trees: dict[str, tuple[Path, int | None]] = {
        ("gateway" if w == "default" else f"gateway w{w}"): (
            REPO,
            None if w == "default" else int(w),
        )
        for w in args.workers.split(",")
    }
    baseline = None
    if args.baseline:
        baseline = baseline_tree(args.baseline, work / "baseline-tree")
        if baseline is not None:
            trees["baseline"] = (baseline, args.baseline_workers)
    backend = start_echo_backend(
        subprocess_mode=True,
        tokens=MAX_TOKENS,
        delay_ms=preset["delay_ms"],
        token_delay_ms=preset["token_delay_ms"],
        stream_interval=args.stream_interval,
    )
    gateways = {
        name: Gateway.start(
            name,
            backend=backend.url,
            tokenizer=tokenizer,
            data_dir=work / name.replace(" ", "-"),
            capture=True,
            repo=tree,
            profiler=args.profiler,
            workers=workers,
            profile=Path(args.profile).resolve() / f"{name}.prof" if args.profile else None,
        )
        for name, (tree, workers) in trees.items()
    }
    n, conc = args.requests or preset["requests"], args.concurrency
    rounds = args.rounds or preset["rounds"]
    relay = start_relay(backend.url)
    try:
        episodes = rounds * 2 * (args.warmup + n) // args.turns + 8 * conc
        async with aiohttp.ClientSession() as session:
            for gw in gateways.values():
                await gw.ready(session)
                gw.keys = await gw.make_keys(session, args.session_mode, episodes)
        print(
            f"{args.preset}: echo backend {preset['delay_ms']:g} ms to the first token, "
            f"then {preset['token_delay_ms']:g} ms per token, {MAX_TOKENS} tokens, a chunk every "
            f"{args.stream_interval} token(s) after the first; {conc} closed-loop "
            f"clients; {n} requests per path and round after {args.warmup} warm-up; "
            f"{rounds} rounds, order rotating; capture on; {os.cpu_count()} CPUs shared by "
            f"load, backend and gateway(s); paths: direct, {RELAY} (direct through "
            f"benchmarks/tcp_relay.py), {', '.join(gateways)}",
            flush=True,
        )
        keys = {name: itertools.cycle(gw.keys) for name, gw in gateways.items()}
        results: dict[str, list[Result]] = {}
        for k in range(rounds):
            for mode in ("non-stream", "stream"):
                stream = mode == "stream"
                runs = [
                    ("direct", direct_sender(backend.url, ids, stream), itertools.repeat(""), None),
                    (RELAY, direct_sender(relay.url, ids, stream), itertools.repeat(""), relay.pid),
                ]
                runs += [
                    (name, gateway_sender(gw.url, stream), keys[name], gw.proc.pid)
                    for name, gw in gateways.items()
                ]
                runs = runs[k % len(runs) :] + runs[: k % len(runs)]  # rotate the order
                for name, send, run_keys, pid in runs:
                    r = await drive(
                        f"{name} {mode}", send, n, conc, args.warmup, run_keys, args.turns, pid
                    )
                    results.setdefault(r.label, []).append(r)
                    cpu = f" CPU {r.cpu_ms:.2f} ms/req" if r.cpu_ms is not None else ""
                    ttft = f" TTFT {r.pct(0.5, r.ttfts):.1f}" if r.ttfts else ""
                    print(
                        f"  round {k + 1} {r.label:22} {r.rps:6.0f} req/s p50 "
                        f"{r.pct(0.5):6.1f} ms{ttft}{cpu}",
                        flush=True,
                    )
        print("\n".join(pace_report(results, list(gateways), targets=args.preset == "stream-pace")))
        if "baseline" in gateways:
            print("\n".join(baseline_report(results, args.baseline_label)))
        print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    finally:
        relay.stop()
        for gw in gateways.values():
            gw.stop()
        backend.stop()
        if baseline is not None and baseline.is_relative_to(work):
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(baseline)],
                cwd=REPO,
                capture_output=True,
                check=False,
            )
        shutil.rmtree(work, ignore_errors=True)


def baseline_tree(ref: str, scratch: Path) -> Path | None:
    """The source tree to measure as the baseline: `ref` itself when it is a directory (a
    checkout of the old code), else a commit (`file`: the one in `BASELINE_FILE`) checked
    out with `git worktree add` under `scratch` (removed after the run). None, with a line
    saying why, when the commit is not in this clone (e.g. a shallow one)."""
    if Path(ref).is_dir():
        return Path(ref).resolve()
    if ref == "file":
        ref = BASELINE_FILE.read_text().split()[0]
    made = subprocess.run(
        ["git", "worktree", "add", "--detach", str(scratch), ref],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        print(
            f"baseline {ref}: not measured: git worktree add failed: {made.stderr.strip()[-300:]}",
            flush=True,
        )
        return None
    return scratch


def baseline_report(results: dict[str, list[Result]], label: str) -> list[str]:
    """This tree's gateway against the baseline's, measured in the same rounds: req/s and
    CPU ratios per mode, CPU per streamed token, and a warning line when a CPU cost rose
    more than `CPU_WARN` (noise on a busy host is a few percent; it never fails the run)."""

    def med(name: str, mode: str, f: Callable[[Result], float | None]) -> float:
        return _median([v for r in results[f"{name} {mode}"] if (v := f(r)) is not None])

    def per_token(name: str) -> float:
        return (
            1000
            * (
                med(name, "stream", lambda r: r.cpu_ms)
                - med(name, "non-stream", lambda r: r.cpu_ms)
            )
            / MAX_TOKENS
        )

    out = [
        "",
        f"this tree vs baseline {label} (same rounds; ratio = this / baseline):",
        f"{'':12} {'req/s':>15} {'CPU ms/req':>19} {'CPU us/token':>21}",
    ]
    rises: list[str] = []
    for mode in ("non-stream", "stream"):
        rps = [med(n, mode, lambda r: r.rps) for n in ("gateway", "baseline")]
        cpu = [med(n, mode, lambda r: r.cpu_ms) for n in ("gateway", "baseline")]
        line = (
            f"{mode:12} {rps[0]:5.0f}/{rps[1]:<5.0f} {rps[0] / rps[1]:4.2f}x "
            f"{cpu[0]:5.2f}/{cpu[1]:<5.2f} {cpu[0] / cpu[1]:5.2f}x"
        )
        if cpu[0] > cpu[1] * (1 + CPU_WARN):
            rises.append(f"CPU per {mode} request {cpu[0] / cpu[1] - 1:+.0%}")
        if mode == "stream":
            tok = [per_token(n) for n in ("gateway", "baseline")]
            line += f" {tok[0]:6.1f}/{tok[1]:<6.1f} {tok[0] / tok[1]:5.2f}x"
            if tok[0] > tok[1] * (1 + CPU_WARN):
                rises.append(f"CPU per streamed token {tok[0] / tok[1] - 1:+.0%}")
        out.append(line)
    if rises:
        out.append(
            f"WARNING: gateway CPU rose more than {CPU_WARN:.0%} against baseline "
            f"{label}: {'; '.join(rises)}. Profile the hot path before merging "
            "(docs/benchmarks/gateway-performance.md), or move the baseline on purpose."
        )
    else:
        out.append(f"gateway CPU within {CPU_WARN:.0%} of baseline {label} (or below).")
    return out


RELAY = "relay"
"""The preset's floor path: direct load through `benchmarks.tcp_relay`."""


@dataclass
class Relay:
    """A `benchmarks.tcp_relay` child process in front of the backend."""

    url: str
    proc: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def start_relay(backend_url: str) -> Relay:
    """A relay to `backend_url`, listening once this returns."""
    port = free_port()
    target = backend_url.removeprefix("http://").rstrip("/")
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.tcp_relay", "--port", str(port), "--to", target],
        cwd=REPO,
    )
    end = time.monotonic() + 30
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return Relay(f"http://127.0.0.1:{port}", proc)
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            raise RuntimeError("the tcp relay did not start")
        time.sleep(0.05)


def pace_report(
    results: dict[str, list[Result]], names: list[str], targets: bool = True
) -> list[str]:
    """The preset's table (medians over rounds) and its targets."""

    def med(label: str, f: Callable[[Result], float | None]) -> float:
        return _median([v for r in results[label] if (v := f(r)) is not None])

    out = [
        "",
        f"{'path':20} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'TTFT p50':>8} "
        f"{'vs direct':>9} {'CPU ms/req':>10} {'(kernel)':>8} {'CPU us/token':>12} "
        f"{'(kernel)':>8} {'reads/req':>9}",
    ]
    for mode in ("non-stream", "stream"):
        d_rps = med(f"direct {mode}", lambda r: r.rps)
        for name in ["direct", RELAY, *names]:
            label = f"{name} {mode}"
            rps = med(label, lambda r: r.rps)
            ttft = (
                f"{med(label, lambda r: r.pct(0.5, r.ttfts)):8.1f}"
                if mode == "stream"
                else f"{'':8}"
            )
            cpu = med(label, lambda r: r.cpu_ms) if name != "direct" else None
            kernel = med(label, lambda r: r.sys_cpu_ms) if name != "direct" else None
            per_token = ""
            if cpu is not None and kernel is not None and mode == "stream":
                ns = med(f"{name} non-stream", lambda r: r.cpu_ms)
                ns_kernel = med(f"{name} non-stream", lambda r: r.sys_cpu_ms)
                per_token = (
                    f"{1000 * (cpu - ns) / MAX_TOKENS:12.1f} "
                    f"{1000 * (kernel - ns_kernel) / MAX_TOKENS:8.1f}"
                )
            cpus = f"{'':10} {'':8}" if cpu is None else f"{cpu:10.2f} {kernel:8.2f}"
            if mode == "stream":
                per_token = (
                    per_token or f"{'':12} {'':8}"
                ) + f" {med(label, lambda r: r.reads):9.1f}"
            out.append(
                f"{label:20} {rps:7.0f} {med(label, lambda r: r.pct(0.5)):7.1f} "
                f"{med(label, lambda r: r.pct(0.99)):7.1f} {ttft} {rps / d_rps:8.2f}x "
                f"{cpus} {per_token}"
            )
    out.append(
        "(CPU us/token: the gateway CPU a streamed request costs over the same request "
        "not streamed, per token; (kernel): the part in system calls; reads/req: "
        "network reads of a streamed body at the client, about the server's writes: "
        "fewer when a lagging server coalesces tokens); relay: the direct load through "
        "a Python byte relay (no parsing), the floor of per-token forwarding in Python"
    )
    for name in names if targets else ():
        ratios = {
            mode: med(f"{name} {mode}", lambda r: r.rps) / med(f"direct {mode}", lambda r: r.rps)
            for mode in ("non-stream", "stream")
        }
        ttft = med(f"{name} stream", lambda r: r.pct(0.5, r.ttfts)) - med(
            "direct stream", lambda r: r.pct(0.5, r.ttfts)
        )
        p50 = med(f"{name} stream", lambda r: r.pct(0.5)) - med(
            "direct stream", lambda r: r.pct(0.5)
        )
        out.append(
            f"  {name}: stream {ratios['stream']:.2f}x [>= {PACE_TARGETS['stream']}x: "
            f"{_ok(ratios['stream'] >= PACE_TARGETS['stream'])}]  non-stream "
            f"{ratios['non-stream']:.2f}x [>= {PACE_TARGETS['non-stream']}x: "
            f"{_ok(ratios['non-stream'] >= PACE_TARGETS['non-stream'])}]  TTFT p50 "
            f"{ttft:+.1f} ms [<= +{PACE_TARGETS['ttft_ms']:g}: "
            f"{_ok(ttft <= PACE_TARGETS['ttft_ms'])}]  stream p50 {p50:+.1f} ms [<= "
            f"+{PACE_TARGETS['stream_p50_ms']:g}: {_ok(p50 <= PACE_TARGETS['stream_p50_ms'])}]"
        )
    return out


# ------------------------------------------------------------------ gateway runner
PROFILERS = ("cprofile", "yappi")


def track_gc() -> dict[int, list[float]]:
    """Per generation: [collections, total s, longest s] since the last SIGUSR1 (logged
    when the runner exits)."""
    import gc

    stats: dict[int, list[float]] = {g: [0, 0.0, 0.0] for g in range(3)}
    started = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        entry = stats[info["generation"]]
        entry[0] += 1
        entry[1] += took
        entry[2] = max(entry[2], took)

    def reset(*_: object) -> None:
        for entry in stats.values():
            entry[:] = [0, 0.0, 0.0]

    gc.callbacks.append(callback)
    signal.signal(signal.SIGUSR1, reset)  # the orchestrator resets once startup is over
    return stats


def summarize_samples(path: Path, top: int = 40) -> str:
    """Self and inclusive share of samples per function, from `py-spy record --format
    raw` output (collapsed stacks: `frame;frame;... count`). With `--gil`, only samples
    of the thread holding the GIL count: the gateway's real cost on a GIL-bound process."""
    self_n: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]  # py-spy: per line
        total += int(n)
        self_n[frames[-1]] = self_n.get(frames[-1], 0) + int(n)
        for fr in set(frames):
            incl[fr] = incl.get(fr, 0) + int(n)
    out = [f"{total} busy samples", "self %  frame"]
    out += [
        f"{100 * n / total:5.1f}  {fr}"
        for fr, n in sorted(self_n.items(), key=lambda x: -x[1])[:top]
    ]
    out += ["incl %  frame"]
    out += [
        f"{100 * n / total:5.1f}  {fr}" for fr, n in sorted(incl.items(), key=lambda x: -x[1])[:top]
    ]
    return "\n".join(out)


def serve(argv: list[str]) -> None:
    """`serve --set k=v ... [--profile FILE [--profiler cprofile|yappi]]`: run_gateway
    (load_config(overrides)). cProfile sees the main thread (the event loop) only; yappi
    (not a dependency: `pip install --target DIR yappi`, then PYTHONPATH=DIR) measures
    CPU time in every thread, the store writer's included."""
    p = argparse.ArgumentParser(prog="gateway_overhead serve")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--profile", default=None)
    p.add_argument("--profiler", choices=PROFILERS, default="cprofile")
    args = p.parse_args(argv)
    import logging

    from areal_service.config import load_config
    from gateway.server import run_gateway

    logging.basicConfig(level=logging.WARNING)
    config = load_config(overrides=args.overrides)
    gc_times = track_gc()
    atexit.register(
        lambda: logging.warning("gc [count, total s, max s] by generation: %s", gc_times)
    )
    # uvicorn re-raises SIGTERM after its graceful shutdown; exit through `finally`/atexit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.profile is None:
        run_gateway(config)
        return
    if args.profiler == "yappi":
        import yappi

        yappi.set_clock_type("cpu")
        yappi.start()
        try:
            run_gateway(config)
        finally:
            yappi.stop()
            yappi.get_func_stats().save(args.profile, "pstat")
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run_gateway(config)
    finally:
        profiler.disable()
        profiler.dump_stats(args.profile)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(sys.argv[2:])
        return
    if len(sys.argv) > 2 and sys.argv[1] == "summarize":  # a py-spy raw profile
        print(summarize_samples(Path(sys.argv[2])))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--stream-requests", type=int, default=600)
    p.add_argument("--warmup", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument(
        "--delay-ms", type=float, default=5.0, help="echo sleep before the first token (prefill)"
    )
    p.add_argument(
        "--token-delay-ms",
        type=float,
        default=2.0,
        help="realistic setting: echo sleep before each token (decode)",
    )
    p.add_argument(
        "--slow-token-delay-ms",
        type=float,
        default=10.0,
        help="typical-LLM setting (0: skip it), run with half the requests",
    )
    p.add_argument("--session-mode", choices=sorted(SESSION_MODES), default="episode")
    p.add_argument("--turns", type=int, default=8, help="requests per episode (session key)")
    p.add_argument("--no-zero-delay", action="store_true", help="skip the zero-delay setting")
    p.add_argument("--profile", default=None, help="directory for the gateways' profiles")
    p.add_argument("--profiler", choices=PROFILERS, default="cprofile")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="stream-pace: issue 14's delayed-token setting (see PACE); zero-delay: "
        "the same against a backend that answers at once (CPU-bound)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="also measure the gateway of this source tree or commit (`file`: the "
        "commit in benchmarks/baseline-commit) in the same rounds, and print "
        "the ratios (implies --preset stream-pace unless a preset is given)",
    )
    p.add_argument(
        "--baseline-workers",
        type=int,
        default=None,
        help="gateway.scale.workers of the baseline (default: its config's own)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="CI's short form: one round of 300 requests per path (CPU columns)",
    )
    p.add_argument("--rounds", type=int, default=0, help="with --preset (default 3)")
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="with --preset: the backend streams a chunk every N tokens after the "
        "first (SGLang's --stream-interval)",
    )
    p.add_argument(
        "--workers",
        default="default",
        help="with --preset: gateway.scale.workers values to measure, e.g. "
        "default,1,2 (default: the config's own, what a user gets)",
    )
    p.add_argument(
        "--tokenizer-dir", default=str(Path(tempfile.gettempdir()) / "areal-bench-tokenizer-32k")
    )
    args = p.parse_args()
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    run: Callable[[Awaitable[None]], None] = asyncio.run  # type: ignore[assignment]
    with contextlib.suppress(ImportError):
        import uvloop

        run = uvloop.run
    if args.quick:
        args.preset = args.preset or "zero-delay"
        args.rounds, args.warmup = args.rounds or QUICK["rounds"], QUICK["warmup"]
        if args.requests == 1500:
            args.requests = QUICK["requests"]
    if args.baseline and args.preset is None:
        # Only the preset measures two source trees in the same rounds; without this the
        # flag was silently ignored and the run compared nothing.
        print(
            "--baseline: measuring with --preset stream-pace (the setting that compares "
            "this tree with the baseline's in the same rounds)",
            flush=True,
        )
        args.preset = "stream-pace"
    args.baseline_label = args.baseline
    if args.baseline == "file":
        args.baseline_label = BASELINE_FILE.read_text().split()[0][:12]
    if args.preset in PRESETS:
        if args.requests == 1500:  # not given: the preset's count
            args.requests = 0
        run(run_pace(args))
        return
    run(orchestrate(args))


if __name__ == "__main__":
    main()
