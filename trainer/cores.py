"""The trainer's side of the CPU share (`areal_service/cpu_share.py`): one trainer
process beside the local engine takes every core while the engine is idle, its
`trainer.torch_threads` while the engine generates."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from areal_service.config import ServiceConfig
from areal_service.cpu_share import CpuShare
from trainer.model import DistInfo, decoder_layers


def share_cores(
    config: ServiceConfig, model: torch.nn.Module, info: DistInfo, cleanup: contextlib.ExitStack
) -> CpuShare | None:
    """Follow the share in `model`'s decoder layers, before each one's forward and each
    one's backward (the engine's state is re-read tens of milliseconds apart, so the two
    overlap on the same cores for at most that long). None when `config.cpu_share` is
    off or the trainer has several processes (their split is fixed). The caller says
    when the trainer is idle: `share.follow(False)`."""
    if not config.cpu_share or info.world_size > 1:
        return None
    share = CpuShare(config.cpu_share_file(), "trainer", share=torch.get_num_threads())
    cleanup.callback(share.close)

    def before_backward(_grad: torch.Tensor) -> None:
        share.follow(True)

    def before_forward(_module: torch.nn.Module, _args: Any) -> None:
        share.follow(True)

    def after_forward(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        # The gradient of a layer's output arrives just before that layer's backward.
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(before_backward)

    for layer in decoder_layers(model):
        cleanup.callback(layer.register_forward_pre_hook(before_forward).remove)
        cleanup.callback(layer.register_forward_hook(after_forward).remove)
    return share
