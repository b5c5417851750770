"""Writing received tensors into a served model's live parameters, checked first: shared
by a full-weight load (`runner.ModelRunner.load_named_tensors`) and an adapter swap
(`lora.AdapterSlot`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def copy_checked(
    live: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    error: type[Exception],
) -> None:
    """Copy each of `new` into the live tensor of its name (cast to its dtype and device),
    every shape checked before the first copy, so a misfit raises `error` with the served
    tensors untouched. Every name of `new` must be in `live`."""
    for name, tensor in new.items():
        if tensor.shape != live[name].shape:
            raise error(f"{name}: shape {tuple(tensor.shape)} != served {tuple(live[name].shape)}")
    for name, tensor in new.items():
        live[name].copy_(tensor)
