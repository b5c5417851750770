"""The published LoRA adapter's on-disk layout, shared by the trainer (writes it), the
local engine and the gateway's vLLM client (load it). PEFT's `save_pretrained` layout:
`adapter_config.json` (rank, alpha, target modules) + `adapter_model.safetensors`.
Torch-free: the gateway imports it.
"""

from __future__ import annotations

from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NAME = "areal-lora"
"""The one name the current adapter is served under on vLLM (replaced in place at each
version), and what the gateway sends as the model name once LoRA is on."""


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` holds a LoRA adapter (rather than a full HF checkpoint)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()
