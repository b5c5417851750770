"""The service on a GPU with SGLang and a real checkpoint: chat throughput through the
gateway with capture on, weight-swap time per GB on the disk path, and the trainer's
MFU on the same checkpoint, all in one run and printed side by side.

1. One SGLang server (`python -m sglang.launch_server`, through the launcher's
   supervisor) on `--gpus`, then the gateway (`areal-service serve` as a child process,
   SQLite store, capture on).
2. Chat: `--requests` chats from `--concurrency` concurrent `openai` clients, each
   asking for `--max-tokens` tokens (`ignore_eos` is not an OpenAI field, so the length
   depends on the model: the completion tokens SGLang reports are what is counted).
   Every reply must be in the store with ids, logprobs and versions.
3. Swap (disk): `--swaps` versions published as store rows pointing at copies of the
   checkpoint. The gateway's syncer does pause, `/update_weights_from_disk`, continue.
   Its `swap_s` divided by the checkpoint's safetensors size gives s/GB. The same update
   sent straight to SGLang (idle, no pause) is timed as well.
4. Trainer MFU: the servers are stopped, then one FSDP2 process (bf16 compute, fp32
   master) runs `train_step` on packed synthetic sequences. MFU = 6 * params * tokens/s
   / peak (attention FLOPs left out, so it reads low for long rows).

Run (a GPU host; SGLang installed here or in another venv):

    AREAL_BENCH_MODEL=/models/Qwen2.5-0.5B-Instruct \
    python -m benchmarks.sglang_gpu [--sglang-python /venvs/sglang/bin/python] \
        [--gpus 0] [--tp 1] [--requests 256] [--concurrency 32] [--max-tokens 256] \
        [--swaps 3] [--peak-tflops 989] [--skip-mfu]

`--peak-tflops` is the GPU's dense bf16 peak (989 on H100/H200 SXM). Nothing here runs
without a GPU; `tests/integration/test_sglang_gpu.py` is the pass/fail counterpart.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpoint_gb(model_dir: Path) -> float:
    """Size of the weights SGLang loads (safetensors), in GB (1e9 bytes)."""
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) / 1e9


async def _chat_load(
    url: str, key: str, model: str, requests: int, concurrency: int, max_tokens: int
) -> tuple[float, int, list[str]]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600)
    todo = iter(range(requests))
    tokens, ids = 0, []

    async def worker() -> None:
        nonlocal tokens
        for i in todo:
            reply = await client.chat.completions.create(
                model=model,
                max_tokens=max_tokens,
                messages=[
                    {
                        "role": "user",
                        "content": f"Story {i}: write a long tale about a "
                        "lighthouse keeper and a storm.",
                    }
                ],
            )
            tokens += reply.usage.completion_tokens
            ids.append(reply.id)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return wall, tokens, ids


def _wait_swapped(store, version: int, timeout_s: float = 900.0) -> float:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = store.get_weight_version(version)
        if row is not None and "swap_s" in row.metadata:
            return float(row.metadata["swap_s"])
        time.sleep(0.2)
    raise TimeoutError(f"version {version} not swapped in after {timeout_s:.0f} s")


def serve_and_measure(args: argparse.Namespace, model_dir: Path, work: Path) -> dict:
    """Phases 1-3: SGLang + gateway, chat load, disk swaps."""
    from areal_service.config import load_config, with_gateway_section
    from areal_service.store import TrajectoryStore
    from areal_service.types import WeightVersionRecord
    from launcher.processes import ChildProcess, cli_argv, save_config
    from launcher.sglang_servers import Supervisor

    key = "sk-bench-admin"
    cfg = load_config(
        None,
        [
            f"data_dir={work}",
            "engine.backend=sglang",
            f"engine.model={model_dir}",
            f"engine.port={_free_port()}",
            f"gateway.port={_free_port()}",
            f"gateway.auth.admin_key={key}",
            f"engine.sglang.gpus=[{args.gpus}]",
            f"engine.sglang.tp_size={args.tp}",
            "engine.sglang.servers=1",
            f"engine.sglang.python={args.sglang_python}",
            "engine.sglang.mem_fraction_static=0.8",
            "gateway.router.weight_poll_interval_s=0.05",
            "log_level=warning",
        ],
    )
    results: dict = {}
    t0 = time.perf_counter()
    with Supervisor.for_config(cfg) as sglang:
        results["sglang_start_s"] = time.perf_counter() - t0
        [backend] = sglang.urls
        gw_cfg = with_gateway_section(cfg, "router", backends=[backend])
        gateway = ChildProcess(
            "gateway",
            cli_argv("serve", "--config", str(save_config(gw_cfg, work / "gateway.yaml"))),
            log_path=work / "gateway.log",
        )
        store = None
        try:
            url = f"http://127.0.0.1:{cfg.gateway.port}"
            gateway.wait_http_ok(f"{url}/health/liveness", 300)
            asyncio.run(_chat_load(url, key, cfg.gateway.model_name, 4, 4, 16))  # warm-up
            wall, tokens, ids = asyncio.run(
                _chat_load(
                    url,
                    key,
                    cfg.gateway.model_name,
                    args.requests,
                    args.concurrency,
                    args.max_tokens,
                )
            )
            results.update(
                chat_wall_s=wall,
                chat_tokens=tokens,
                tokens_per_s=tokens / wall,
                requests_per_s=args.requests / wall,
            )
            store = TrajectoryStore.open(cfg.database_url(), cfg.store)
            records = [store.get_completion(i) for i in ids]
            captured = [
                r
                for r in records
                if r is not None
                and len(r.output_ids) == len(r.output_logprobs) == len(r.output_versions) > 0
            ]
            results["captured"] = f"{len(captured)}/{len(ids)}"

            copy = work / "weights-copy"
            shutil.copytree(model_dir, copy)
            size = checkpoint_gb(model_dir)
            swaps = []
            for version in range(1, args.swaps + 1):
                path = copy if version % 2 else model_dir
                store.add_weight_version(WeightVersionRecord(version=version, path=str(path)))
                swaps.append(_wait_swapped(store, version))
            results.update(checkpoint_gb=size, swap_s=min(swaps), swap_s_per_gb=min(swaps) / size)
            t0 = time.perf_counter()  # the same update, straight to the idle server
            reply = httpx.post(
                f"{backend}/update_weights_from_disk",
                timeout=900,
                json={"model_path": str(copy), "weight_version": "direct", "flush_cache": True},
            )
            direct = time.perf_counter() - t0
            assert reply.status_code == 200 and reply.json().get("success"), reply.text
            results.update(direct_swap_s=direct, direct_swap_s_per_gb=direct / size)
        finally:
            if store is not None:
                store.close()
            gateway.stop()
    return results


def trainer_mfu(args: argparse.Namespace, model_dir: Path) -> dict:
    """Phase 4: tokens/s and MFU of one FSDP2 train_step on this GPU."""
    import torch

    from areal_service.config import TrainerConfig
    from areal_service.types import TrainSequence
    from trainer.batch import build_micro_batches
    from trainer.model import apply_fsdp2, destroy_distributed, init_distributed, load_policy
    from trainer.step import build_optimizer, train_step

    os.environ.setdefault("CUDA_VISIBLE_DEVICES", args.gpus.split(",")[0])
    info = init_distributed()
    try:
        model = apply_fsdp2(load_policy(model_dir), mixed_precision=True)
        params = sum(p.numel() for p in model.parameters())
        cfg = TrainerConfig(group_size=2)
        optimizer = build_optimizer(model, cfg)
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        seqs, half = [], args.seq_len // 2
        for i in range(args.sequences):
            ids = torch.randint(0, vocab, (args.seq_len,), generator=gen).tolist()
            mask = [0] * half + [1] * (args.seq_len - half)
            seqs.append(
                TrainSequence(
                    session_id=f"s{i}",
                    group_id=None,
                    completion_ids=(f"c{i}",),
                    input_ids=tuple(ids),
                    loss_mask=tuple(mask),
                    logprobs=tuple(-2.0 * m for m in mask),
                    versions=tuple(m - 1 for m in mask),
                    reward=float(i % 2),
                )
            )
        advantages = [1.0 if i % 2 else -1.0 for i in range(len(seqs))]
        mbs = [
            mb.to(info.device) for mb in build_micro_batches(seqs, advantages, args.tokens_per_mb)
        ]
        train_step(model, optimizer, mbs, cfg)  # warm-up (allocator, kernels)
        cuda = info.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        rates = []
        for _ in range(args.train_steps):
            stats = train_step(model, optimizer, mbs, cfg)
            rates.append(stats.tokens_per_s)
        tokens_per_s = sorted(rates)[len(rates) // 2]
        return {
            "params_b": params / 1e9,
            "train_tokens_per_s": tokens_per_s,
            "mfu": 6 * params * tokens_per_s / (args.peak_tflops * 1e12),
            "train_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
        }
    finally:
        destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=os.environ.get("AREAL_BENCH_MODEL"),
        help="HF checkpoint directory (or AREAL_BENCH_MODEL).",
    )
    parser.add_argument(
        "--sglang-python", default=sys.executable, help="Interpreter with SGLang installed."
    )
    parser.add_argument("--gpus", default="0", help="GPU ids for the server, e.g. 0,1.")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--swaps", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens-per-mb", type=int, default=8192)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--skip-mfu", action="store_true")
    args = parser.parse_args()
    if not args.model:
        parser.error("--model or AREAL_BENCH_MODEL is required")
    model_dir = Path(args.model).resolve()
    with tempfile.TemporaryDirectory(prefix="areal-sglang-bench-") as tmp:
        results = serve_and_measure(args, model_dir, Path(tmp))
    if not args.skip_mfu:
        results.update(trainer_mfu(args, model_dir))
    print(
        f"model {model_dir.name}: {results.get('checkpoint_gb', 0):.2f} GB safetensors, "
        f"SGLang tp={args.tp} on GPU(s) {args.gpus}"
    )
    rows = [
        ("SGLang start (load + warm-up)", f"{results['sglang_start_s']:.1f} s"),
        (
            "chat through gateway, capture on",
            f"{results['tokens_per_s']:.0f} tokens/s, {results['requests_per_s']:.1f} req/s "
            f"({args.concurrency} clients, {results['chat_tokens']} tokens)",
        ),
        ("captured completions", results["captured"]),
        (
            "swap via gateway (disk, pause+update+continue)",
            f"{results['swap_s']:.2f} s = {results['swap_s_per_gb']:.2f} s/GB",
        ),
        (
            "update_weights_from_disk direct (idle)",
            f"{results['direct_swap_s']:.2f} s = {results['direct_swap_s_per_gb']:.2f} s/GB",
        ),
    ]
    if "mfu" in results:
        rows.append(
            (
                "trainer FSDP2 step (1 GPU, bf16)",
                f"{results['train_tokens_per_s']:.0f} tokens/s, MFU "
                f"{100 * results['mfu']:.1f}% of {args.peak_tflops:.0f} TFLOP/s, "
                f"peak mem {results['train_mem_gb']:.1f} GB",
            )
        )
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
