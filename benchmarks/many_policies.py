"""Many runtime policies against none: the weight syncer's round, chat latency and the
gateway's idle CPU, measured in one run on one deployment.

One `areal-service serve --no-train` (local engine, the tiny model unless `--model`,
LoRA rank 2, `policy_caps.max_policies` raised to `--policies`) in a child process:

1. baseline, no runtime policy: `--requests` chat completions from `--clients`
   closed-loop clients (`max_tokens` 8, the admin key, the default policy), their p50;
   the syncer's round (`areal_weight_sync_round_seconds`, sampled every 0.2 s for
   `--idle-s` seconds, median and max) and the serve process's CPU over that idle window;
2. `--policies` runtime policies created through `POST /admin/policies`, one after
   another (timed: all, and the mean of the first and last 100);
3. the same measures as 1.

Printed: each figure at 0 policies, at N, and their ratio, beside the targets (syncer
round under 0.2 s; chat p50 within 1.2x of no policies). The policies have no published
version (what the audit measured: the syncer read each one's versions every round).

Run: `python -m benchmarks.many_policies [--policies 1000] [--requests 300]
[--clients 4] [--idle-s 10] [--model DIR]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.policy_swap import serve_no_train, served

ADMIN_KEY = "sk-bench-many-policies"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
ROUND = re.compile(r"^areal_weight_sync_round_seconds(?:\{[^}]*\})? ([0-9.e+-]+)$", re.M)


def start_serve(args: argparse.Namespace, work: Path, model: Path, port: int) -> object:
    """`areal-service serve --no-train` with the cap raised; the child once ready."""
    sets = [
        "default_policy.lora.rank=2",
        "default_policy.lora.alpha=4",
        f"policy_caps.max_policies={args.policies}",
        "gateway.scale.workers=1",  # one process: its CPU is the serve process's
    ]
    return serve_no_train(work, model, port, ADMIN_KEY, sets, 600)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its threads (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def chat_p50(http: httpx.AsyncClient, requests: int, clients: int) -> float:
    """p50 seconds of `requests` chat completions from `clients` closed-loop clients."""
    times: list[float] = []
    left = iter(range(requests))
    model = (await http.get("/v1/models")).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

    async def client() -> None:
        for _ in left:
            t0 = time.perf_counter()
            reply = await http.post("/v1/chat/completions", json=body)
            if reply.status_code != 200:
                raise SystemExit(f"chat: {reply.status_code} {reply.text}")
            times.append(time.perf_counter() - t0)

    await asyncio.gather(*(client() for _ in range(clients)))
    return statistics.median(times)


async def idle(http: httpx.AsyncClient, pid: int, seconds: float) -> tuple[float, float, float]:
    """(median round s, max round s, CPU %) of the serve process over `seconds` without
    traffic (the gauge read every 0.2 s)."""
    rounds: list[float] = []
    cpu0, t0 = cpu_s(pid), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        found = ROUND.search((await http.get("/metrics")).text)
        if found:
            rounds.append(float(found.group(1)))
        await asyncio.sleep(0.2)
    cpu = 100 * (cpu_s(pid) - cpu0) / (time.perf_counter() - t0)
    return statistics.median(rounds), max(rounds), cpu


async def measure(http: httpx.AsyncClient, args: argparse.Namespace, pid: int) -> dict[str, float]:
    p50 = await chat_p50(http, args.requests, args.clients)
    median, worst, cpu = await idle(http, pid, args.idle_s)
    return {
        "chat p50 ms": 1e3 * p50,
        "round median s": median,
        "round max s": worst,
        "idle CPU %": cpu,
    }


async def create(http: httpx.AsyncClient, count: int) -> list[float]:
    """Create `count` runtime policies one after another; each creation's seconds."""
    took = []
    for i in range(count):
        t0 = time.perf_counter()
        reply = await http.post("/admin/policies", json={"name": f"p{i:05d}"})
        if reply.status_code != 201:
            raise SystemExit(f"creating policy {i}: {reply.status_code} {reply.text}")
        took.append(time.perf_counter() - t0)
    return took


async def drive(args: argparse.Namespace, port: int, pid: int) -> list[str]:
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", headers=ADMIN, timeout=120
    ) as http:
        await chat_p50(http, 20, 1)  # warm-up
        base = await measure(http, args, pid)
        took = await create(http, args.policies)
        many = await measure(http, args, pid)
    lines = [
        f"created {args.policies} policies in {sum(took):.1f} s (first 100: "
        f"{1e3 * statistics.mean(took[:100]):.1f} ms each, last 100: "
        f"{1e3 * statistics.mean(took[-100:]):.1f} ms each)",
        f"{'':18}{'0 policies':>12}{f'{args.policies} policies':>16}{'ratio':>8}",
    ]
    for name, value in base.items():
        ratio = many[name] / value if value else float("nan")
        lines.append(f"{name:18}{value:12.4g}{many[name]:16.4g}{ratio:8.2f}")
    p50_ratio = many["chat p50 ms"] / base["chat p50 ms"]
    lines.append(
        f"targets: syncer round under 0.2 s: {'met' if many['round max s'] < 0.2 else 'MISSED'}"
        f" ({many['round max s']:.3f} s max); chat p50 within 1.2x: "
        f"{'met' if p50_ratio <= 1.2 else 'MISSED'} ({p50_ratio:.2f}x)"
    )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--model", type=Path, default=None, help="default: the tiny model")
    args = parser.parse_args(argv)
    with served("many-policies-", args, start_serve) as (_, model, port, child):
        lines = asyncio.run(drive(args, port, child.proc.pid))
    print(f"model {model.name}, {args.clients} clients x {args.requests} chats of 8 tokens")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
