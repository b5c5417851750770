"""One trainer process's start, on every rank: the process group, stop signals, CPU
threads and seeds; and rank 0's objects broadcast to the others. Touches no store and
no model."""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from transformers.utils import logging as hf_logging

from areal_service.config import TrainerConfig
from trainer.model import DistInfo, destroy_distributed, init_distributed

log = logging.getLogger(__name__)


def start_process(
    cfg: TrainerConfig, stop: threading.Event, cleanup: contextlib.ExitStack
) -> DistInfo:
    """Join the process group (creating it when torchrun did not), route SIGTERM/SIGINT
    to `stop`, set torch's CPU threads and seed `random` and torch per rank. `cleanup`
    undoes it: the handlers are restored, and the group is destroyed only if this call
    created it (a caller's own group outlives the trainer)."""
    if not dist.is_initialized():
        cleanup.callback(destroy_distributed)
    info = init_distributed()
    cleanup.callback(install_signal_handlers(stop))
    hf_logging.disable_progress_bar()  # per-load/save tqdm bars only clutter the log
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    random.seed(cfg.seed + info.rank)
    torch.manual_seed(cfg.seed + info.rank)
    return info


def install_signal_handlers(stop: threading.Event) -> Callable[[], None]:
    """SIGTERM/SIGINT set `stop`: a batch being collected is abandoned (claims released),
    a step being trained is finished and published, then the loop ends; a
    second signal gets the default behaviour. Returns a function restoring the old
    handlers. Signals can only be handled in the main thread: elsewhere, `stop` only."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(signum: int, _frame: object) -> None:
        log.warning("%s: stopping after the current hop", signal.Signals(signum).name)
        stop.set()
        for sig in previous:  # the next one is not caught
            signal.signal(
                sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            )

    for sig in previous:
        signal.signal(sig, on_signal)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (a no-op copy at world size 1)."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
