"""Does swapping one policy's adapter disturb another policy's traffic? One run, one
deployment (`areal-service serve` with two declared policies, `a` and `b`, in a child
process, as deployed), phases alternating:

- quiet (the baseline): `--streams` clients of policy `b` stream chat completions back
  to back for `--phase-s` seconds;
- swapping: the same load while policy `a`'s adapter is published every
  `--swap-every-s` seconds (a new version row in the store, which the gateway's syncer
  swaps in, as a trainer's publish would) and each waits until it is live.

Printed per phase kind (pooled over `--rounds` of each, alternating so drift on a
shared machine hits both): `b`'s requests, failures, latency p50 and p95 of the whole
stream, the swaps done, and the gateway's resubmitted generations (`a` sends nothing,
so every resubmission would be a `b` request cut by a swap); then the ratios of p50 and
p95, swapping against quiet.

`--backend local` (default): the local engine (the tiny model unless `--model`).
`--backend vllm`: vLLM-CPU with `engine.backend: vllm` and the same `policies:`
(needs the vLLM multi-policy support in `gateway/backends/vllm.py`, `--model` a
checkpoint vLLM loads, and `--vllm-python`).

Run: `python -m benchmarks.policy_swap [--backend local|vllm] [--model DIR]
[--rounds 2] [--phase-s 20] [--streams 4] [--swap-every-s 0.5]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from areal_service.config import StoreConfig
from areal_service.store import TrajectoryStore
from areal_service.types import WeightVersionRecord
from benchmarks.gateway_overhead import free_port
from benchmarks.lora_swap import write_adapter

ADMIN_KEY = "sk-bench-policy-swap-admin"
POLICIES = "[{name: a}, {name: b}]"


@dataclass
class Phase:
    """One phase's outcome."""

    kind: str
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    swaps: int = 0
    resubmissions: float = 0.0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_serve(args: argparse.Namespace, work: Path, model: Path, port: int) -> object:
    """`areal-service serve` with the two policies; the child once the gateway is ready."""
    sets = [
        f"default_policy.lora.rank={args.rank}",
        f"default_policy.lora.alpha={2 * args.rank}",
        f"policies={POLICIES}",
    ]
    if args.backend == "vllm":
        sets += ["engine.backend=vllm", f"engine.vllm.python={args.vllm_python}"]
    return serve_no_train(work, model, port, ADMIN_KEY, sets, args.ready_timeout)


@contextlib.contextmanager
def served(
    prefix: str,
    args: argparse.Namespace,
    start: Callable[[argparse.Namespace, Path, Path, int], object],
) -> Iterator[tuple[Path, Path, int, Any]]:
    """(work dir, model, gateway port, serve child) for a benchmark's run: a temporary
    work dir, `args.model` or the tiny model made there, `start(args, work, model, port)`
    started on a free port and stopped at the end."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from engine.tiny_model import make_tiny_model

            model = make_tiny_model(work / "tiny")
        port = free_port()
        child: Any = start(args, work, model, port)
        try:
            yield work, model, port, child
        finally:
            child.stop()


def serve_no_train(
    work: Path, model: Path, port: int, admin_key: str, sets: list[str], ready_s: float
) -> object:
    """`areal-service serve --no-train` (the benchmark publishes any versions itself) on
    `model` at `port`, data in `work / "serve"`, no staleness gate, with `sets` on top;
    the child process once the gateway is ready."""
    from launcher.processes import ChildProcess, cli_argv

    base = [
        f"data_dir={work / 'serve'}",
        f"engine.model={model}",
        f"engine.port={free_port()}",
        "gateway.host=127.0.0.1",
        f"gateway.port={port}",
        f"gateway.auth.admin_key={admin_key}",
        "gateway.sessions.staleness_gate=false",
        "log_level=warning",
    ]
    argv = cli_argv(
        "serve", "--no-train", *itertools.chain.from_iterable(("--set", s) for s in base + sets)
    )
    child = ChildProcess("serve", argv, log_path=work / "serve.log")
    child.wait_http_ok(f"http://127.0.0.1:{port}/health/readiness", timeout_s=ready_s)
    return child


async def stream_once(http: httpx.AsyncClient, key: str, max_tokens: int, n: int) -> float:
    """One streamed completion of policy `b` to its end; its seconds."""
    t0 = time.perf_counter()
    body = {
        "model": "agent",
        "messages": [{"role": "user", "content": f"Tell me about number {n}."}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    async with http.stream(
        "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        tail = b""
        async for chunk in r.aiter_bytes():
            tail = (tail + chunk)[-64:]
        if b"[DONE]" not in tail:
            raise RuntimeError("stream ended without [DONE]")
    return time.perf_counter() - t0


async def resubmitted(http: httpx.AsyncClient) -> float:
    text = (await http.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"})).text
    for line in text.splitlines():
        if line.startswith("areal_resubmissions_total "):
            return float(line.split()[1])
    return 0.0


async def run_phase(
    args: argparse.Namespace,
    http: httpx.AsyncClient,
    key: str,
    kind: str,
    swap: object | None,
) -> Phase:
    phase = Phase(kind)
    before = await resubmitted(http)
    end = time.monotonic() + args.phase_s
    counter = itertools.count()

    async def client() -> None:
        while time.monotonic() < end:
            try:
                phase.latencies.append(await stream_once(http, key, args.max_tokens, next(counter)))
            except Exception as exc:  # noqa: BLE001 - counted and shown
                phase.failures.append(f"{type(exc).__name__}: {exc}")

    async def swapper() -> None:
        assert callable(swap)
        while time.monotonic() + args.swap_every_s < end:
            await asyncio.sleep(args.swap_every_s)
            await swap()
            phase.swaps += 1

    tasks = [client() for _ in range(args.streams)]
    if swap is not None:
        tasks.append(swapper())
    await asyncio.gather(*tasks)
    phase.resubmissions = await resubmitted(http) - before
    return phase


def report(phases: list[Phase]) -> list[str]:
    lines = [
        f"{'phase':<28} {'requests':>8} {'failed':>6} {'p50 s':>8} {'p95 s':>8} "
        f"{'swaps':>6} {'resubmitted':>11}"
    ]
    pooled: dict[str, Phase] = {}
    for p in phases:
        into = pooled.setdefault(p.kind, Phase(p.kind))
        into.latencies += p.latencies
        into.failures += p.failures
        into.swaps += p.swaps
        into.resubmissions += p.resubmissions
    for kind, label in (("quiet", "b alone (baseline)"), ("swap", "b while a is swapped")):
        p = pooled[kind]
        lines.append(
            f"{label:<28} {len(p.latencies):>8} {len(p.failures):>6} "
            f"{statistics.median(p.latencies):>8.4f} {pct(p.latencies, 0.95):>8.4f} "
            f"{p.swaps:>6} {p.resubmissions:>11.0f}"
        )
    quiet, swap = pooled["quiet"].latencies, pooled["swap"].latencies
    lines.append(
        f"b's p50 with swaps / without: {statistics.median(swap) / statistics.median(quiet):.3f}"
        f"; p95: {pct(swap, 0.95) / pct(quiet, 0.95):.3f}"
    )
    per_round = [f"{p.kind} {statistics.median(p.latencies):.4f}" for p in phases]
    lines.append("p50 per phase, in order: " + ", ".join(per_round))
    for p in pooled.values():
        for failure in p.failures[:3]:
            lines.append(f"  {p.kind} failure: {failure}")
    return lines


async def drive(args: argparse.Namespace, work: Path, model: Path, port: int) -> list[str]:
    url = f"sqlite:///{(work / 'serve' / 'areal.db').resolve()}"
    store = TrajectoryStore.open(url, StoreConfig(auto_migrate=False))  # the gateway's
    adapters = [
        write_adapter(str(model), work / f"a-adapter-{i}", args.rank, seed=i) for i in (1, 2)
    ]
    version = 0

    async def swap() -> None:
        """Publish policy a's next version and wait until the gateway made it live."""
        nonlocal version
        version += 1
        path = adapters[version % 2]
        store.add_weight_version(
            WeightVersionRecord(version=version, path=str(path.resolve()), policy="a")
        )
        deadline = time.monotonic() + 60
        while "live_at" not in store.get_weight_version(version, "a").metadata:  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                raise RuntimeError(f"a v{version} never went live")
            await asyncio.sleep(0.01)

    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=120, limits=httpx.Limits()
        ) as http:
            created = await http.post(
                "/admin/keys",
                json={"policy": "b"},
                headers={"authorization": f"Bearer {ADMIN_KEY}"},
            )
            created.raise_for_status()
            key = created.json()["api_key"]
            await swap()  # a's adapter is loaded once before anything is timed
            # Warm-up, not measured: the first requests pay one-time costs.
            warm = argparse.Namespace(**{**vars(args), "phase_s": min(5.0, args.phase_s)})
            await run_phase(warm, http, key, "quiet", None)
            phases = []
            for _ in range(args.rounds):
                phases.append(await run_phase(args, http, key, "quiet", None))
                phases.append(await run_phase(args, http, key, "swap", swap))
    finally:
        store.close()
    return report(phases)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("local", "vllm"), default="local")
    parser.add_argument("--model", type=Path, default=None, help="default: the tiny model")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--swap-every-s", type=float, default=0.5)
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if args.backend == "vllm" and (args.model is None or args.vllm_python is None):
        parser.error("--backend vllm needs --model and --vllm-python")
    with served("policy-swap-", args, start_serve) as (work, model, port, _):
        lines = asyncio.run(drive(args, work, model, port))
    print(
        f"backend {args.backend}, model {model.name}, {args.streams} streams of "
        f"{args.max_tokens} tokens, {args.rounds} x {args.phase_s:g} s per phase kind, "
        f"a swapped every {args.swap_every_s:g} s"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
