"""LoRA training of the policy (`default_policy.lora`, or a named policy's `lora`): PEFT
wraps the loaded HF model before FSDP2 shards it, the base weights are frozen and only
the adapter's `lora_A`/`lora_B` matrices train, under the same loss and step code as
full fine-tuning.

FSDP2 (`fully_shard`) shards frozen and trainable parameters of one group alike and
keeps `requires_grad` per parameter, so the PEFT model is sharded exactly like the plain
one (decoder layers, then the root) and the optimizer sees only the adapter's shards.
Publishing gathers only the trainable tensors (`ignore_frozen_params`: the adapter, a
few MB, not the base) and writes PEFT's layout (`areal_service/lora_adapter.py`).
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from areal_service.atomic import atomic_dir
from areal_service.config import LoRAConfig
from areal_service.lora_adapter import ADAPTER_WEIGHTS

if TYPE_CHECKING:  # peft is imported on first use: ~1.3 s that full fine-tuning skips
    from peft import LoraConfig, PeftModel

log = logging.getLogger(__name__)

_ADAPTER_KEY = re.compile(r"\.(lora_[AB])\.weight$")


def peft_config(cfg: LoRAConfig) -> LoraConfig:
    """PEFT's LoraConfig of a policy's `lora` shape. B starts at zero (PEFT's default init), so
    the untrained adapter leaves the base model's outputs unchanged: v0 is the base."""
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap_lora(model: torch.nn.Module, cfg: LoRAConfig, seed: int = 0) -> PeftModel:
    """`model` with adapters on `cfg.target_modules`; only they require grad. Call before
    `apply_fsdp2`, with the same `seed` on every rank: A's random init is drawn here,
    and `fully_shard` keeps each rank's slice of its OWN full tensor, so ranks seeded
    differently would train a patchwork of several inits (the base is loaded from disk
    and needs no such care). The caller's RNG state is left as it was."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, peft_config(cfg))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    log.info(
        "LoRA r=%d alpha=%g on %s: %d trainable of %d parameters (%.2f%%)",
        cfg.rank,
        cfg.alpha,
        ",".join(cfg.target_modules),
        trainable,
        total,
        100 * trainable / total,
    )
    return peft_model


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` trains a PEFT adapter (also once FSDP2 changed its class). Without
    peft imported, no model can be one."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _trainable_state(model: PeftModel) -> dict[str, torch.Tensor]:
    """Full tensors of the trainable parameters (the adapter) under the live module's
    names on rank 0, {} elsewhere. Collective; the frozen base is never gathered."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=options)
    return state if dist.get_rank() == 0 else {}


def adapter_state(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's full tensors under PEFT's saved names on rank 0, {} elsewhere.
    Collective."""
    from peft import get_peft_model_state_dict

    state = _trainable_state(model)
    return get_peft_model_state_dict(model, state_dict=state) if state else {}


def save_adapter(model: PeftModel, out_dir: Path, *, overwrite: bool = False) -> Path:
    """Write the adapter (`adapter_config.json` + `adapter_model.safetensors`) to
    `out_dir` atomically (temp dir + rename, as `model.save_hf_checkpoint`). Collective."""
    state = _trainable_state(model)
    if dist.get_rank() == 0:
        if out_dir.exists() and not overwrite:
            raise FileExistsError(f"{out_dir} exists; weights directories are written once")
        with atomic_dir(out_dir) as tmp:
            # PEFT renames the live names to its saved ones itself
            model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            (tmp / "README.md").unlink(missing_ok=True)  # PEFT's model card template
        log.info("saved LoRA adapter to %s", out_dir)
    dist.barrier()
    return out_dir


def _model_names(
    state: dict[str, torch.Tensor], adapter: str = "default"
) -> dict[str, torch.Tensor]:
    """PEFT's saved names (`...q_proj.lora_A.weight`) -> the live module's names
    (`...q_proj.lora_A.default.weight`)."""
    return {_ADAPTER_KEY.sub(rf".\1.{adapter}.weight", k): v for k, v in state.items()}


def load_adapter_weights(model: PeftModel, path: Path) -> None:
    """Load a published adapter (`weights/vN`) into the wrapped model, sharded or not.
    Collective: rank 0 reads the file and sends every rank the full tensors (a few MB;
    `broadcast_from_rank0` would also materialise the frozen base it was not given)."""
    holder: list[Any] = [
        _model_names(load_file(path / ADAPTER_WEIGHTS)) if dist.get_rank() == 0 else None
    ]
    dist.broadcast_object_list(holder, src=0)
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, holder[0], options=options)
    log.info("loaded published LoRA adapter from %s", path)


def write_initial_adapter(model_dir: Path, cfg: LoRAConfig, out_dir: Path) -> Path:
    """The untrained adapter (B = 0: outputs equal the base model's) at `out_dir`, for
    a server that must start with the adapter's name already served (vLLM's
    `--lora-modules`). Not collective; written once (kept when present). Costs one load
    of the base model on CPU."""
    if (out_dir / ADAPTER_WEIGHTS).is_file():
        return out_dir
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with atomic_dir(out_dir) as tmp:
        get_peft_model(model, peft_config(cfg)).save_pretrained(tmp, safe_serialization=True)
        (tmp / "README.md").unlink(missing_ok=True)
    log.info("wrote the initial (untrained) LoRA adapter to %s", out_dir)
    return out_dir
