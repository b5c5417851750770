"""The trained policy on every rank: the initial checkpoint loaded and sharded with FSDP2,
its optimizer, the frozen reference for the KL penalty, and its EOS ids."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from areal_service.config import ServiceConfig, TrainerConfig
from areal_service.serving_plan import ServingPlan
from trainer.lora import wrap_lora
from trainer.model import DistInfo, load_policy, load_reference, resolve_dtype, shard_or_keep
from trainer.step import build_optimizer

log = logging.getLogger(__name__)


@dataclass
class Policy:
    """What one rank trains with."""

    model: torch.nn.Module
    """The policy, sharded (FSDP2)."""
    optimizer: torch.optim.Optimizer
    """AdamW over `model`'s shards."""
    reference: torch.nn.Module | None
    """pi_ref for the KL penalty; None when `trainer.kl_coef` is 0."""
    model_dir: Path
    """The initial checkpoint (v0); its tokenizer is published with every version unless
    `gateway.tokenizer` names another."""


def build_policy(config: ServiceConfig, info: DistInfo) -> Policy:
    """Load v0, shard it, and build its optimizer and reference. FSDP2 shards the module
    it is given, so whatever changes the trained module goes between load and shard."""
    cfg = config.trainer
    model_dir = prepare_model_dir(config)
    model = load_policy(model_dir)
    # The trained policy's own adapter shape (the serving plan's); None (every weight
    # trains) for a full-weight default policy or a policy with `weights: full`.
    lora = ServingPlan(config).lora(cfg.policy)
    if lora is not None:  # frozen base + trainable adapter, same step code
        model = wrap_lora(model, lora, seed=cfg.seed)  # one init on every rank
    bf16 = resolve_dtype(cfg.dtype, info.device.type) == torch.bfloat16
    model = shard_or_keep(model, mixed_precision=bf16)
    reference = reference_model(cfg, model_dir, mixed_precision=bf16)
    optimizer = build_optimizer(model, cfg)
    return Policy(model, optimizer, reference, model_dir)


def prepare_model_dir(config: ServiceConfig) -> Path:
    """The initial checkpoint (v0): the engine's model. The launcher builds the tiny model
    before starting the trainer when none is configured; the trainer only loads."""
    model_dir = config.model_dir()
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"no checkpoint at {model_dir}: set engine.model, or build the tiny model there "
            f"first (`areal-service make-tiny-model {model_dir}`; `areal-service trainer` "
            "and `areal-service demo --trainer-procs N` do it for you)"
        )
    dist.barrier()
    return model_dir


def reference_model(
    cfg: TrainerConfig, model_dir: Path, *, mixed_precision: bool
) -> torch.nn.Module | None:
    """pi_ref for the KL penalty: `trainer.ref_model`, else the initial checkpoint
    `model_dir` (v0; also after a resume, so the penalty anchors to where training
    started, not to the last checkpoint). None, and nothing loaded, when kl_coef is 0."""
    if cfg.kl_coef == 0:
        return None
    path = Path(cfg.ref_model) if cfg.ref_model else model_dir
    log.info("KL penalty %g: reference model from %s", cfg.kl_coef, path)
    return load_reference(path, mixed_precision=mixed_precision)
