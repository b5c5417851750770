"""The policy model under FSDP2: process-group setup, loading an HF causal LM, sharding
each decoder layer and the root with `fully_shard`, gathering a full state dict and
publishing it as an HF safetensors checkpoint (written to a temp dir, then renamed).

World size 1 on CPU (gloo) runs the same step, publish and checkpoint code as torchrun
on GPUs (nccl); only the wrapper differs (`shard_or_keep`: a single float32 process
keeps the plain module). Recipe: `load_policy(dir, device="cpu", dtype=torch.float32)`
then `shard_or_keep(model, mixed_precision=resolve_dtype(cfg.dtype) == torch.bfloat16)`:
fully_shard moves each rank's shard to the mesh device; master weights and optimizer
state stay float32, compute runs in bf16 under mixed precision. Touches no store.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from areal_service.atomic import atomic_dir
from trainer.packed_attention import register_packed_sdpa

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the default process group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(device_type: str = "auto") -> DistInfo:
    """Join the default process group: nccl on CUDA, gloo on CPU (`auto`: CUDA when
    present; `cpu` forces gloo and CPU even on a GPU machine).

    Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set) it rendezvous through
    `env://`. Launched plainly it forms a group of one on an in-process HashStore
    instead of a loopback port (no port to race for; same init_process_group call).
    Idempotent: an existing group is reused.
    """
    kind = _device_type() if device_type == "auto" else device_type
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        backend = "nccl" if kind == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, init_method="env://")
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def destroy_distributed() -> None:
    """Leave the default process group, if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()


def resolve_dtype(name: str, device_type: str | None = None) -> torch.dtype:
    """TrainerConfig.dtype -> torch dtype. `auto`: bfloat16 on CUDA, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if (device_type or _device_type()) == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def load_policy(
    model_dir: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """An HF causal LM from `model_dir` in train mode. Attention: `PACKED_SDPA` by
    default (sdpa that attends within each packed sequence, `trainer/packed_attention.py`);
    `flash_attention_2` (when installed) does the same on CUDA; plain `sdpa` and `eager`
    handle packed rows through position_ids with an L x L mask."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attn_implementation or register_packed_sdpa()
    )
    model.config.use_cache = False
    return model.to(device).train()


def load_reference(model_dir: str | Path, *, mixed_precision: bool = False) -> PreTrainedModel:
    """The frozen reference policy pi_ref of the KL penalty: loaded like the policy and
    sharded the same way (`shard_or_keep`: FSDP2 over the default group, the same mixed precision, so
    its logprobs are computed exactly as the policy's), in eval mode, with no
    parameter requiring grad; it is given no optimizer. Memory per rank: one shard of
    the weights (the policy additionally holds grads and two AdamW moments)."""
    model = load_policy(model_dir)
    model.requires_grad_(False)
    model.eval()
    return shard_or_keep(model, mixed_precision=mixed_precision)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks HF names in `_no_split_modules` (e.g. Qwen2DecoderLayer)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to shard")
    return layers


def shard_or_keep(model: PreTrainedModel, *, mixed_precision: bool) -> PreTrainedModel:
    """FSDP2 (`apply_fsdp2`) where it does something: over several processes, or for
    bfloat16 mixed precision. A single float32 process keeps the plain module: there
    FSDP2 only copies (it gathers every layer's parameters before its forward and again
    before its backward, and copies the gradients back into shards), 13% of the demo's
    step on a CPU (`benchmarks/trainer_step.py`). The step, publish and checkpoint code
    takes both."""
    if dist.get_world_size() == 1 and not mixed_precision:
        return model
    return apply_fsdp2(model, mixed_precision=mixed_precision)


def apply_fsdp2(
    model: PreTrainedModel, *, mesh: DeviceMesh | None = None, mixed_precision: bool = False
) -> PreTrainedModel:
    """Shard every decoder layer, then the root (embeddings, final norm, lm_head; a tied
    lm_head stays one parameter because both ends live in the root group).

    mixed_precision: compute in bfloat16, reduce gradients in float32, keep the
    parameters in their loaded dtype. The module is sharded in place and returned.
    """
    if mesh is None:  # the default group's backend says where the shards live
        kind = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(kind, (dist.get_world_size(),))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors on rank 0, {} on other ranks. Collective: every rank
    must call it. Peak host memory on rank 0: one full copy of the model."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def _untied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` without the tied copies (e.g. `lm_head.weight` of a tied-embedding model).
    At world size > 1 the gathered state holds them as separate tensors, which
    save_pretrained would write, so the checkpoint would depend on the world size."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return state
    tied = getattr(model, "_tied_weights_keys", None) or ()
    return {k: v for k, v in state.items() if k not in tied}


TIED_HEAD_FILE = "tied-head.safetensors"


def write_tied_head(model: torch.nn.Module, state: dict[str, torch.Tensor], out: Path) -> None:
    """The tied output head (e.g. `lm_head.weight`, the input embedding's values) as a
    file of its own beside the checkpoint, for vLLM. vLLM's in-place `reload_weights`
    (0.32) replaces each layer's tensors from the file; a tied head has no tensor in an
    HF checkpoint, so its layer keeps the OLD weights ("ParallelLMHead: Failed to load
    weights" in its log) and serves new hidden states through the old head, silently.
    With the tensor present, it is loaded. A sharded checkpoint's index names the file
    too (vLLM reads only indexed files); HF and SGLang tie the head again on load."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    pairs = tied.items() if isinstance(tied, dict) else ()
    head = {dst: state[src].contiguous() for dst, src in pairs if src in state}
    if not head:
        return
    save_file(head, str(out / TIED_HEAD_FILE), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        tree = json.loads(index.read_text())
        tree["weight_map"].update(dict.fromkeys(head, TIED_HEAD_FILE))
        index.write_text(json.dumps(tree, indent=2))


@functools.lru_cache(maxsize=4)
def _tokenizer(tokenizer_dir: str) -> Any:
    """The published tokenizer, loaded once per trainer: parsing a tokenizer.json took a
    few hundred milliseconds of every publish (SmolLM2), for the same files each time."""
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def save_hf_checkpoint(
    model: PreTrainedModel,
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    state: dict[str, torch.Tensor] | None = None,
    tied_head_file: bool = False,
) -> Path:
    """Write model safetensors + config + generation config + tokenizer to `out_dir`
    atomically: rank 0 writes a sibling temp dir and renames it, so a reader sees either
    no `out_dir` or a complete one. Collective (every rank calls it); returns `out_dir`.

    An existing `out_dir` raises FileExistsError unless `overwrite` (then the old one is
    removed just before the rename: a reader may briefly see no directory). `state`: the
    full state dict already gathered by `full_state_dict` (then no gather happens here).
    `tied_head_file`: also write a tied output head as a tensor (`write_tied_head`; for
    vLLM backends).
    """
    out = Path(out_dir)
    if state is None:
        state = full_state_dict(model)
    if dist.get_rank() == 0:
        full = state
        state = _untied(model, state)
        if out.exists() and not overwrite:
            raise FileExistsError(f"{out} exists; weights directories are written once")
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            if tied_head_file and getattr(model.config, "tie_word_embeddings", False):
                write_tied_head(model, full, tmp)
            _tokenizer(str(tokenizer_dir)).save_pretrained(tmp)
        log.info("saved HF checkpoint to %s (%d tensors)", out, len(state))
    dist.barrier()
    return out
