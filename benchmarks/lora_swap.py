"""Adapter swap vs full-weight swap on one vLLM server (`default_policy.lora`), in one run.

One vLLM server is started with the launcher's command line for `default_policy.lora`
(`--enable-lora`, the untrained adapter served under `areal-lora`), and the gateway's
own client (`gateway.backends.vllm.VLLMClient.swap_weights`: pause → load → version
label → resume) swaps it alternately to a full checkpoint (`reload_weights`, the
baseline: what full fine-tuning publishes) and to an adapter (`/v1/load_lora_adapter`,
`load_inplace`), `--rounds` times each. Printed: median and min seconds of the load
phase and of the whole swap for each, their ratio, and the bytes each version writes
(adapter_model.safetensors vs the checkpoint's safetensors). Also the largest |vLLM -
PEFT| logprob under the adapter (fp32), the tolerance test_lora_vllm.py holds.

Run: `python -m benchmarks.lora_swap --model DIR [--vllm-python PATH] [--rank 8]` (DIR
from `areal-service make-model smollm2-135m-instruct DIR`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import torch

from benchmarks.vllm_gateway import VLLM_GRACE_S, free_port, start_vllm

PROMPTS = ["What is 3 + 4?", "Name a colour.", "Count to five.", "Why is the sky blue?"]


def write_adapter(model_dir: str, out: Path, rank: int, seed: int) -> Path:
    """A trained-looking adapter (A and B random, nonzero) in PEFT's layout."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from areal_service.config import LoRAConfig
    from trainer.lora import peft_config

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        peft_config(LoRAConfig(rank=rank, alpha=2.0 * rank)),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.03)
    model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)
    return out


def write_full(model_dir: str, out: Path) -> Path:
    """The base checkpoint as the trainer publishes it for vLLM (tied head as a tensor)."""
    from transformers import AutoModelForCausalLM

    from trainer.model import write_tied_head

    shutil.copytree(model_dir, out)
    model = AutoModelForCausalLM.from_pretrained(out)
    write_tied_head(model, model.state_dict(), out)
    return out


def tensor_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


async def swap_rounds(
    url: str, full: Path, adapters: list[Path], rounds: int
) -> dict[str, list[tuple[float, float]]]:
    """(load seconds, whole swap seconds) per swap kind, alternating kinds."""
    from areal_service.lora_adapter import ADAPTER_NAME
    from gateway.backends.vllm import VLLMClient

    client = VLLMClient(url, lora_name=ADAPTER_NAME, timeout_s=600)
    out: dict[str, list[tuple[float, float]]] = {"full": [], "adapter": []}
    version = 0
    try:
        for i in range(rounds):
            for kind, path in (("full", full), ("adapter", adapters[i % len(adapters)])):
                version += 1
                t = await client.swap_weights(str(path), version)
                out[kind].append((t.update_s, t.total_s))
    finally:
        await client.aclose()
    return out


def adapter_logprob_gap(url: str, model_dir: str, adapter: Path) -> tuple[float, float]:
    """Largest |vLLM - PEFT| logprob of seeded samples under `adapter` (fp32), and, to
    show the adapter is what is served, the largest |vLLM - base model|."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_service.lora_adapter import ADAPTER_NAME
    from trainer.loss import token_logprobs

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter
    ).eval()
    worst = off_base = 0.0
    for seed, prompt in enumerate(PROMPTS):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        reply = httpx.post(
            f"{url}/inference/v1/generate",
            timeout=300,
            json={
                "token_ids": ids,
                "model": ADAPTER_NAME,
                "sampling_params": {
                    "max_tokens": 32,
                    "temperature": 1.0,
                    "seed": seed,
                    "logprobs": 0,
                    "ignore_eos": True,
                },
            },
        ).json()["choices"][0]
        out = reply["token_ids"]
        served = torch.tensor([c["logprob"] for c in reply["logprobs"]["content"]])
        full = torch.tensor([ids + out])
        with torch.no_grad():
            logits = model(input_ids=full).logits[0, len(ids) - 1 : -1]
            with model.disable_adapter():
                base_logits = model(input_ids=full).logits[0, len(ids) - 1 : -1]
        mine = token_logprobs(logits, torch.tensor(out))[0]
        base = token_logprobs(base_logits, torch.tensor(out))[0]
        worst = max(worst, float((mine - served).abs().max()))
        off_base = max(off_base, float((base - served).abs().max()))
    return worst, off_base


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--vllm-python", default=os.environ.get("AREAL_VLLM_PYTHON", sys.executable)
    )
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    from areal_service.config import load_config
    from launcher.vllm_servers import prepare_lora

    with tempfile.TemporaryDirectory(prefix="lora-swap-") as tmp:
        work = Path(tmp)
        full = write_full(args.model, work / "full")
        adapters = [write_adapter(args.model, work / f"adapter-{s}", args.rank, s) for s in (1, 2)]
        lora = (
            f"default_policy.lora.rank={args.rank}",
            f"default_policy.lora.alpha={2.0 * args.rank}",
        )
        # the untrained adapter the server starts with, where start_vllm's config puts it
        prepare_lora(
            load_config(
                overrides=[f"data_dir={work / 'vllm'}", f"engine.model={args.model}", *lora]
            )
        )
        child, url = start_vllm(args, work, free_port(), *lora, "engine.dtype=float32")
        try:
            times = asyncio.run(swap_rounds(url, full, adapters, args.rounds))
            asyncio.run(swap_rounds(url, full, adapters[-1:], 1))  # end on the adapter
            gap = adapter_logprob_gap(url, args.model, adapters[-1])
        except BaseException:
            log = work / "vllm.log"
            print(log.read_text()[-4000:] if log.exists() else "(no vLLM log)")
            raise
        finally:
            child.stop(VLLM_GRACE_S)
        a_bytes, f_bytes = tensor_bytes(adapters[0]), tensor_bytes(full)
    print(
        f"\nvLLM-CPU, {Path(args.model).name}, LoRA rank {args.rank}, {args.rounds} swaps each "
        "(gateway's VLLMClient.swap_weights; seconds)"
    )
    print(f"{'swap':<28}{'load median':>12}{'load min':>10}{'total median':>14}{'total min':>11}")
    rows = {"full weights (baseline)": times["full"], "adapter, in place": times["adapter"]}
    for label, samples in rows.items():
        loads, totals = [s[0] for s in samples], [s[1] for s in samples]
        print(
            f"{label:<28}{statistics.median(loads):>12.4f}{min(loads):>10.4f}"
            f"{statistics.median(totals):>14.4f}{min(totals):>11.4f}"
        )
    ratio = statistics.median(s[1] for s in times["full"]) / statistics.median(
        s[1] for s in times["adapter"]
    )
    print(f"adapter swap is {ratio:.1f}x faster than the full-weight swap (median total)")
    print(
        f"bytes per version: adapter {a_bytes / 2**20:.2f} MiB vs full checkpoint "
        f"{f_bytes / 2**20:.1f} MiB ({f_bytes / a_bytes:.0f}x)"
    )
    print(
        f"max |vLLM - PEFT| logprob under the adapter (fp32): {gap[0]:.2e}  "
        f"(vs the base model without it: {gap[1]:.3f})"
    )


if __name__ == "__main__":
    main()
