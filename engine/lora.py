"""LoRA adapters on the local engine: a published adapter directory (PEFT's layout,
`areal_service/lora_adapter.py`) is served by injecting PEFT's LoRA layers into the live
model once and copying each new version's `lora_A`/`lora_B` into them in place.

Why unmerged (base + B·A per forward) rather than merging B·A into a copy of the weights:
the trainer computes exactly this form, so the engine's logprobs match the trainer's as
closely as for full weights; a swap copies a few MB instead of rewriting every target
matrix; and no second copy of the base is kept. Cost: one extra low-rank matmul pair per
target module per forward. Once injected, the live model's base weights sit under
`base_layer.*` names, so a full-weights checkpoint no longer matches its keys (refused,
the old weights stay): one engine serves either full-weight or adapter versions.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from safetensors.torch import load_file

from areal_service.lora_adapter import ADAPTER_WEIGHTS

_SAVED_PREFIX = "base_model.model."
_ADAPTER_KEY = re.compile(r"\.(lora_[AB])\.weight$")
_SHAPE_FIELDS = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "bias")
"""LoraConfig fields that decide the injected layers; a new version must keep them."""


class AdapterError(ValueError):
    """An adapter that cannot replace the served one; the old one stays."""


def _shape(config: LoraConfig) -> tuple[object, ...]:
    values = [getattr(config, f) for f in _SHAPE_FIELDS]
    return tuple(sorted(v) if isinstance(v, set | list) else v for v in values)


def read_adapter(path: Path, device: torch.device) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """(config, tensors under the live model's names) of the adapter at `path`."""
    try:
        config = LoraConfig.from_pretrained(str(path))
        saved = load_file(path / ADAPTER_WEIGHTS, device=str(device))
    except (OSError, ValueError, TypeError) as exc:
        raise AdapterError(f"cannot read adapter {path}: {exc}") from exc
    if not isinstance(config, LoraConfig):
        raise AdapterError(f"{path}: not a LoRA adapter ({type(config).__name__})")
    state = {_ADAPTER_KEY.sub(r".\1.default.weight", k.removeprefix(_SAVED_PREFIX)): v
             for k, v in saved.items()}
    return config, state


class AdapterSlot:
    """The LoRA layers injected into one served model, and their shape (None until the
    first adapter arrives). Owned by the runner; not thread-safe."""

    def __init__(self) -> None:
        self.config: LoraConfig | None = None

    @torch.inference_mode()
    def load(self, model: torch.nn.Module, path: Path) -> None:
        """Serve the adapter at `path` on `model`: inject the LoRA layers on first use
        (their B is 0: until a copy succeeds, the outputs stay the base model's), then
        check every name and shape before the first copy. Raises AdapterError, leaving
        the served adapter intact."""
        config, state = read_adapter(path, next(model.parameters()).device)
        if self.config is not None and _shape(config) != _shape(self.config):
            raise AdapterError(f"adapter {path} has another shape (rank, alpha, targets) "
                               "than the served one; restart the engine to change it")
        if self.config is None:
            config.inference_mode = True
            inject_adapter_in_model(config, model)
            self.config = config  # injected once, whatever the copy below decides
        live = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
        missing, unexpected = sorted(set(live) - set(state)), sorted(set(state) - set(live))
        if missing or unexpected:
            raise AdapterError(f"adapter {path} does not fit the model: missing "
                               f"{missing[:3]}, unexpected {unexpected[:3]}")
        for name, tensor in state.items():
            if tensor.shape != live[name].shape:
                raise AdapterError(f"{name}: shape {tuple(tensor.shape)} != served "
                                   f"{tuple(live[name].shape)}")
        for name, tensor in state.items():
            live[name].copy_(tensor)
