"""How far vLLM's behaviour logprobs are from the trainer's forward pass, per serving
dtype, in one run: the number that decides how far decoupled PPO's importance ratio
starts from 1 before any training.

For each dtype (float32, then bfloat16) one vLLM server is started with the launcher's
flags (`launcher/vllm_servers.py`: `--logprobs-mode processed_logprobs`, eager on the
CPU), `--prompts` chat prompts are rendered with the model's template and sampled at
temperature 1 (seeded, `--max-tokens` each) on vLLM's token route, and the trainer's own
forward pass (`trainer.model.load_policy` in float32, `trainer.loss.token_logprobs`) scores
the same ids. Printed: max and mean |difference| per dtype, and the target (<= 1e-3 for
fp32 serving). The fp32 row is the baseline of the bf16 one.

Run: `python -m benchmarks.vllm_logprobs --model DIR [--vllm-python PATH]` (DIR from
`areal-service make-model smollm2-135m-instruct DIR`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import httpx
import torch

from benchmarks.vllm_gateway import VLLM_GRACE_S, free_port, start_vllm

PROMPTS = [
    "Count to ten.",
    "What is 3 + 4?",
    "Name a colour.",
    "Tell me a joke.",
    "Why is the sky blue?",
    "Write a haiku about rain.",
    "List three fruits.",
    "What is the capital of France?",
]


def sample(
    url: str, prompt_ids: list[int], seed: int, max_tokens: int
) -> tuple[list[int], list[float]]:
    """(output ids, vLLM's logprobs) of one seeded sample at temperature 1."""
    reply = httpx.post(
        f"{url}/inference/v1/generate",
        timeout=300,
        json={
            "token_ids": prompt_ids,
            "sampling_params": {
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "seed": seed,
                "logprobs": 0,
                "ignore_eos": True,
            },
        },
    ).json()
    choice = reply["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]


def trainer_scores(model_dir: str, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """The trainer's float32 logprobs of `output_ids` after `prompt_ids`."""
    from trainer.loss import token_logprobs
    from trainer.model import load_policy

    model = trainer_scores.cache.get(model_dir)  # type: ignore[attr-defined]
    if model is None:
        model = trainer_scores.cache[model_dir] = load_policy(model_dir).eval()  # type: ignore[attr-defined]
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
    return token_logprobs(logits, torch.tensor(output_ids))[0]


trainer_scores.cache = {}  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--vllm-python", default=os.environ.get("AREAL_VLLM_PYTHON", sys.executable)
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        for p in (PROMPTS * 4)[: args.prompts]
    ]
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-logprobs-") as tmp:
        for dtype in ("float32", "bfloat16"):
            work = Path(tmp) / dtype
            work.mkdir()
            child, url = start_vllm(args, work, free_port(), f"engine.dtype={dtype}")
            try:
                gaps = []
                for seed, prompt in enumerate(prompts):
                    ids, served = sample(url, list(prompt), seed, args.max_tokens)
                    gaps.append(
                        (trainer_scores(args.model, list(prompt), ids) - torch.tensor(served)).abs()
                    )
            finally:
                child.stop(VLLM_GRACE_S)
            gap = torch.cat(gaps)
            rows.append((dtype, float(gap.max()), float(gap.mean()), gap.numel()))
    print(
        f"\n{'vLLM dtype':<12}{'max |diff|':>12}{'mean |diff|':>13}{'tokens':>8}"
        "   (vs the trainer's float32 forward, nats)"
    )
    for dtype, worst, mean, n in rows:
        print(f"{dtype:<12}{worst:>12.2e}{mean:>13.2e}{n:>8}")
    print(
        f"target: fp32 max <= 1e-3: {'met' if rows[0][1] <= 1e-3 else 'NOT met'}; "
        f"bf16 is {rows[1][1] / max(rows[0][1], 1e-12):.0f}x the fp32 gap"
    )


if __name__ == "__main__":
    main()
