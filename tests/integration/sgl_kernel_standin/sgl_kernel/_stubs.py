"""Stubs for kernels SGLang imports on a CPU but never calls in the tested configuration."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn


def unavailable(name: str) -> Callable[..., NoReturn]:
    def stub(*_args: object, **_kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not in the project's CPU stand-in: the tested "
            "configuration (torch_native attention, no speculative decoding, no "
            "hierarchical cache) never calls it"
        )

    stub.__name__ = name
    return stub
