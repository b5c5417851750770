"""The swap canary's fingerprint of a checkpoint, computed as the trainer computes it
(`trainer/canary.py`: the same rendering and the same forward pass), for tests that
publish versions by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from areal_service.config import SwapVerifyConfig
from trainer.canary import canary_ids, fingerprint, score

CPU = torch.device("cpu")


def logprobs_of(model_dir: Path, tokenizer_dir: Path, config: SwapVerifyConfig) -> Any:
    """The canary and its logprobs under the checkpoint at `model_dir` (float32)."""
    canary = canary_ids(config, tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return canary, score(model, canary, CPU)


def fingerprint_of(
    model_dir: Path,
    tokenizer_dir: Path,
    previous_dir: Path | None = None,
    config: SwapVerifyConfig | None = None,
) -> dict[str, Any]:
    """Metadata `canary` for publishing `model_dir` (contrast: `previous_dir`)."""
    config = config or SwapVerifyConfig(enabled=True)
    canary, now = logprobs_of(model_dir, tokenizer_dir, config)
    before = logprobs_of(previous_dir, tokenizer_dir, config)[1] if previous_dir else None
    return fingerprint(canary, now, before, torch.float32).model_dump()


def scale_one_tensor(model_dir: Path, factor: float = 3.0) -> str:
    """Corrupt a published checkpoint after its fingerprint: one weight matrix of one
    decoder layer scaled by `factor`, in place. Returns its name."""
    (file,) = sorted(model_dir.glob("model*.safetensors"))  # not tied-head.safetensors
    state = load_file(file)
    name = next(n for n in sorted(state) if ".layers.0." in n and n.endswith("proj.weight"))
    state[name] = state[name] * factor
    save_file(state, file, metadata={"format": "pt"})
    return name


def fingerprint_of_model(
    model: torch.nn.Module, tokenizer_dir: Path, previous: torch.nn.Module
) -> dict[str, Any]:
    """Metadata `canary` for publishing `model`'s weights (an adapter's PEFT model: the
    trainer's own forward), with `previous`'s logprobs as the contrast."""
    config = SwapVerifyConfig(enabled=True)
    canary = canary_ids(config, tokenizer_dir)
    now, before = score(model, canary, CPU), score(previous, canary, CPU)
    return fingerprint(canary, now, before, torch.float32).model_dump()


def lora_adapter(base: Path, out: Path, seed: int) -> torch.nn.Module:
    """A trained-looking LoRA adapter (rank 8, alpha 16, B drawn from `seed`) saved in
    PEFT's format at `out` (what `trainer.lora.save_adapter` writes); its PEFT model."""
    from areal_service.config import LoRAConfig
    from trainer.lora import wrap_lora

    model = wrap_lora(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoRAConfig(rank=8, alpha=16),
        seed=seed,
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(out, safe_serialization=True)
    return model
