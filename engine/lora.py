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
from engine.live_weights import copy_checked

_SAVED_PREFIX = "base_model.model."
_ADAPTER_KEY = re.compile(r"\.(lora_[AB])\.weight$")
_SHAPE_FIELDS = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "bias")
"""LoraConfig fields that decide the injected layers; a new version must keep them."""


class AdapterError(ValueError):
    """An adapter that cannot replace the served one; the old one stays."""


def _shape(config: LoraConfig) -> tuple[object, ...]:
    values = [getattr(config, f) for f in _SHAPE_FIELDS]
    return tuple(sorted(v) if isinstance(v, set | list) else v for v in values)


DEFAULT_ADAPTER = "default"
"""The adapter of requests that name none (the default policy): PEFT's own default name,
so a single-policy engine's layers are exactly what they were before names existed."""
BASE = "__base__"
"""PEFT's name for "no adapter" in a mixed batch (a row of a policy not loaded yet: its
untrained adapter has B = 0, so the base model is exactly its version 0)."""


def read_adapter(
    path: Path, device: torch.device, name: str = DEFAULT_ADAPTER
) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """(config, tensors under the live model's names for adapter `name`) of the adapter
    at `path`."""
    try:
        config = LoraConfig.from_pretrained(str(path))
        saved = load_file(path / ADAPTER_WEIGHTS, device=str(device))
    except (OSError, ValueError, TypeError) as exc:
        raise AdapterError(f"cannot read adapter {path}: {exc}") from exc
    if not isinstance(config, LoraConfig):
        raise AdapterError(f"{path}: not a LoRA adapter ({type(config).__name__})")
    state = {
        _ADAPTER_KEY.sub(rf".\1.{name}.weight", k.removeprefix(_SAVED_PREFIX)): v
        for k, v in saved.items()
    }
    return config, state


class AdapterSlot:
    """The LoRA adapters injected into one served model, by name (one per policy), and
    each one's shape. Owned by the runner; not thread-safe.

    With the default adapter alone every row runs under it (PEFT's active adapter, the
    plain forward, as before names existed). Once a named one is loaded, `select` names
    each batch row's adapter before a forward and PEFT's mixed-batch path runs each
    adapter's B·A on its rows only: a forward pre-hook on every LoRA layer, registered
    once, passes the current row list (costs one sub-batch gather per adapter present
    per layer)."""

    def __init__(self) -> None:
        self.configs: dict[str, LoraConfig] = {}
        self._rows: list[str] | None = None
        self._hooked: set[int] = set()
        """ids of the LoRA layers that carry the row hook (an adapter with other target
        modules injects new layers, which get it too)."""

    @property
    def config(self) -> LoraConfig | None:
        """The default adapter's config (None until it is loaded)."""
        return self.configs.get(DEFAULT_ADAPTER)

    def select(self, rows: list[str | None] | None) -> None:
        """Name the adapter of each row of the next forward (None: the default adapter).
        A no-op while only the default adapter is loaded; `rows` must then cover the
        whole batch."""
        self._rows = (
            None if rows is None or not self._hooked else [self._known(name) for name in rows]
        )

    def _known(self, name: str | None) -> str:
        name = name or DEFAULT_ADAPTER
        return name if name in self.configs else BASE

    def _hook(self, model: torch.nn.Module) -> None:
        from peft.tuners.lora import LoraLayer

        def pass_rows(
            _module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
        ) -> tuple[tuple[object, ...], dict[str, object]]:
            if self._rows is not None:
                kwargs["adapter_names"] = self._rows
            return args, kwargs

        for module in model.modules():
            if isinstance(module, LoraLayer) and id(module) not in self._hooked:
                module.register_forward_pre_hook(pass_rows, with_kwargs=True)
                self._hooked.add(id(module))

    @torch.inference_mode()
    def load(self, model: torch.nn.Module, path: Path, name: str = DEFAULT_ADAPTER) -> None:
        """Serve the adapter at `path` on `model` under `name`: inject its LoRA layers on
        first use (their B is 0: until a copy succeeds, the outputs stay the base
        model's), then check every name and shape before the first copy. Raises
        AdapterError, leaving the served adapters intact."""
        config, state = read_adapter(path, next(model.parameters()).device, name)
        served = self.configs.get(name)
        if served is not None and _shape(config) != _shape(served):
            raise AdapterError(
                f"adapter {path} has another shape (rank, alpha, targets) "
                f"than the served {name!r}; restart the engine to change it"
            )
        if served is None:
            config.inference_mode = True
            inject_adapter_in_model(config, model, adapter_name=name)
            self.configs[name] = config  # injected once, whatever the copy below decides
            if set(self.configs) != {DEFAULT_ADAPTER}:
                self._hook(model)  # the layers injected so far, not yet hooked
        own = re.compile(rf"\.lora_[AB]\.{re.escape(name)}\.weight$")
        live = {k: v for k, v in model.state_dict().items() if own.search(k)}
        missing, unexpected = sorted(set(live) - set(state)), sorted(set(state) - set(live))
        if missing or unexpected:
            raise AdapterError(
                f"adapter {path} does not fit the model: missing "
                f"{missing[:3]}, unexpected {unexpected[:3]}"
            )
        copy_checked(live, state, AdapterError)
