"""Weight-update process groups of the local engine: the receiving side of distributed
weight sync (`/init_weights_update_group`, `/update_weights_from_distributed`,
`/destroy_weights_update_group`), SGLang's semantics over gloo (CPU) or nccl (CUDA).

A group is a standalone `ProcessGroupGloo`/`ProcessGroupNCCL` on a `TCPStore` whose
master is the trainer (rank 0), under the key prefixes SGLang's own group uses
(`sglang_protocol.weight_group_store_prefixes`), never the default process group, so an engine can sit
in several groups and a trainer process keeps its own FSDP group untouched. SGLang joins
`tp_size` ranks per server, `rank_offset + tp_rank`; this engine joins as many ranks as
it reports (`engine.emulate_tp_size`, default 1): one group member per rank, all in this
process, each receiving every broadcast (the first into the live weights, the others
into scratch, where a real tp rank would keep its shard). That is a CPU stand-in for
multi-rank servers, so the gateway's rank layout is tested end to end.

Receiving (`receive`): one broadcast per tensor, in the order of `names`, from group
rank 0 (what the trainer sends). A tensor whose live parameter has the same dtype and
shape on the group's device (CPU for gloo) is received straight into that parameter
(no copy; a copy per tensor measured 10-30 ms on a busy 2-core box while gloo's threads
wind down); any other goes to a fresh buffer that the caller validates and casts into
the model, so a bad name or shape still drains the trainer's broadcasts and never
hangs it.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from areal_service.sglang_protocol import weight_group_store_prefixes

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 300.0
"""Longest a rendezvous or one broadcast waits for the other ranks (the trainer)."""


class WeightGroups:
    """Named weight-update groups of this process; thread-safe (HTTP threads create and
    destroy them, the scheduler thread receives)."""

    def __init__(self, timeout_s: float = GROUP_TIMEOUT_S) -> None:
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._groups: dict[str, tuple[list[dist.ProcessGroup], str, list[dist.Store]]] = {}
        self._lock = threading.Lock()

    def init(
        self,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        ranks: int = 1,
    ) -> None:
        """Join as ranks `rank`..`rank + ranks - 1` (blocks until all `world_size` ranks
        joined). Replaces a group of the same name (SGLang raises; a retried sync after
        a failure needs the new one)."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r}: this engine speaks gloo or nccl")
        if backend == "nccl" and ranks != 1:
            raise ValueError("several ranks in one process need gloo")
        if not (0 < rank and rank + ranks <= world_size):
            raise ValueError(
                f"ranks {rank}..{rank + ranks - 1} outside 1..{world_size - 1} "
                "(rank 0 is the trainer)"
            )

        def join(r: int) -> tuple[dist.ProcessGroup, dist.Store]:
            store = dist.TCPStore(
                master_address, master_port, world_size, is_master=False, timeout=self.timeout
            )
            prefixed: dist.Store = store
            for prefix in weight_group_store_prefixes(group_name, backend):
                prefixed = dist.PrefixStore(prefix, prefixed)
            group: dist.ProcessGroup = (
                dist.ProcessGroupGloo(prefixed, r, world_size, self.timeout)
                if backend == "gloo"
                else dist.ProcessGroupNCCL(prefixed, r, world_size)
            )
            group._set_sequence_number_for_group()  # as SGLang's (torch's helper) does
            return group, store

        if ranks == 1:
            joined = [join(rank)]
        else:  # each member's rendezvous blocks until all ranks arrive: join in parallel
            with ThreadPoolExecutor(ranks, thread_name_prefix=f"join-{group_name}") as pool:
                futures = [pool.submit(join, r) for r in range(rank, rank + ranks)]
            failed = [f.exception() for f in futures if f.exception() is not None]
            if failed:  # the ranks that did join would hold their threads and sockets
                for future in futures:
                    if future.exception() is None:
                        _shut_down_later(future.result()[0], group_name)
                raise failed[0]  # type: ignore[misc]
            joined = [f.result() for f in futures]
        self.destroy(group_name)
        with self._lock:
            self._groups[group_name] = ([g for g, _ in joined], backend, [st for _, st in joined])
        logger.info(
            "joined weight-update group %s as rank(s) %d..%d/%d (%s, master %s:%d)",
            group_name,
            rank,
            rank + ranks - 1,
            world_size,
            backend,
            master_address,
            master_port,
        )

    def destroy(self, group_name: str) -> bool:
        """Leave `group_name`; False when not a member."""
        with self._lock:
            found = self._groups.pop(group_name, None)
        if found is None:
            return False
        for group in found[0]:
            _shut_down_later(group, group_name)
        return True

    def receive(
        self,
        group_name: str,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        device: torch.device,
        targets: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """Receive one bucket from rank 0. Tensors matching `targets[name]` (dtype,
        shape, device) land in it in place; the others are returned as {name: tensor}
        (for nccl on `device`, for gloo on CPU) for the caller to check and load.
        KeyError for an unknown group, ValueError for a bad dtype (before receiving)."""
        with self._lock:
            if group_name not in self._groups:
                raise KeyError(
                    f"no weight-update group {group_name!r}; call /init_weights_update_group first"
                )
            groups, backend, _ = self._groups[group_name]
        group, extra = groups[0], groups[1:]
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes differ in length")
        where = device if backend == "nccl" else torch.device("cpu")
        torch_dtypes = [getattr(torch, d.removeprefix("torch."), None) for d in dtypes]
        for name, dtype, torch_dtype in zip(names, dtypes, torch_dtypes, strict=True):
            if not isinstance(torch_dtype, torch.dtype):
                raise ValueError(f"{name}: unknown dtype {dtype!r}")
        received: dict[str, torch.Tensor] = {}
        for name, torch_dtype, shape in zip(names, torch_dtypes, shapes, strict=True):
            target = targets.get(name)
            if not (
                target is not None
                and target.dtype == torch_dtype
                and tuple(target.shape) == tuple(shape)
                and target.device == where
                and target.is_contiguous()
            ):
                target = received[name] = torch.empty(tuple(shape), dtype=torch_dtype, device=where)
            # every member this process holds takes part in the broadcast (async, then
            # waited together: each blocks until rank 0 sent to all)
            works = [
                group.broadcast(target, 0),
                *(g.broadcast(torch.empty_like(target), 0) for g in extra),
            ]
            for work in works:
                work.wait()
        return received


def _shut_down_later(group: dist.ProcessGroup, group_name: str) -> None:
    """Shut `group` down on a thread: ~30 ms (gloo joins its threads), off the caller's
    path."""
    shutdown = getattr(group, "shutdown", None)
    if callable(shutdown):
        threading.Thread(
            target=_quiet_shutdown,
            args=(shutdown, group_name),
            name=f"shutdown-{group_name}",
            daemon=True,
        ).start()


def _quiet_shutdown(shutdown: Callable[[], None], group_name: str) -> None:
    try:
        shutdown()
    except RuntimeError as exc:  # already torn down by a failed peer
        logger.debug("shutdown of %s: %s", group_name, exc)
