"""Distributed weight sync, the trainer's side (`trainer.weight_sync: distributed`): rank 0
broadcasts the full state dict, bucket by bucket, to the backends over a weight-update
process group (gloo on CPU, nccl on GPUs), besides the disk copy.

Who drives what, and why. In SGLang the receive happens INSIDE the HTTP call
`/update_weights_from_distributed`: the server blocks in the broadcast until the trainer
sends, so the HTTP call and the trainer's broadcast must run concurrently. AReaL lets
the trainer make those calls. Here the gateway makes them, so that "only the gateway
talks to backends" still holds, and the gateway's weight syncer keeps owning pause →
update → continue (continue always sent), the backend set (which are healthy, how many
ranks each) and the version bookkeeping, exactly as on the disk path. The trainer only
broadcasts. They meet through the version's row in the store, which both already use:

1. rank 0 inserts the `WeightVersion` row with `metadata.sync` = the OFFER: master
   address and the port of a TCPStore it already listens on, a new group name, the
   group it still holds (`held_group`), backend, the bucket plan (`names`, `dtypes`,
   `shapes` per bucket, as SGLang expects them) and `expires_at`;
2. the gateway's syncer sees the row and, at once, writes its ANSWER on the row
   (`sync_world_size`: 1 + the backends' ranks; `sync_group`: the held group when it
   can be reused, else the new one), pauses the backends and, for a new group, posts
   `/init_weights_update_group` to every backend (rank offsets 1, 2, ...);
3. rank 0, polling its row, reads the answer and joins the new group as rank 0 (the
   rendezvous completes) or takes the held one;
4. per bucket the syncer posts `/update_weights_from_distributed` to every backend
   (the version with the last bucket) while rank 0 broadcasts that bucket's tensors,
   one broadcast per tensor in plan order; then `/continue_generation` (and, after a
   new group, `/destroy_weights_update_group` of the old one);
5. rank 0 records `metadata.sync_sent` (seconds, bytes) or `sync_error`, and writes the
   disk copy (`weights/v{N}`) afterwards, off the swap's critical path: the disk copy
   is what a trainer resumes from, what a backend that was down is re-synced from, and
   what the gateway falls back to when the offer expired or the broadcast failed.

A failure on either side costs at most `trainer.weight_sync_timeout_s` (the offer's
life, the rendezvous and broadcast timeouts) on the trainer, then the disk path.

Group lifetime: the first publish creates a group of the backends healthy then; later
offers name the group rank 0 still holds (`held_group`), and the gateway answers with
that name (`sync_group`) while its healthy backends are the same, so a steady state
costs no rendezvous, no `/init_weights_update_group` and no destroy. When the set
changed (a backend went down, or came back after a disk re-sync), or after any failure,
the gateway answers with the offer's new group and both sides leave the old one.

Tensors go in the dtype the trainer holds them (float32 master weights), as the disk
copy stores them; the backend casts to its serving dtype, so both paths serve
bit-identical weights. Buckets (`trainer.weight_sync_bucket_mb`, ~1 GB by default as in
AReaL) bound each HTTP call, not the memory: rank 0 already holds the gathered state.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from areal_service.sglang_protocol import weight_group_store_prefixes
from areal_service.store import TrajectoryStore

log = logging.getLogger(__name__)

POLL_S = 0.002
"""How often rank 0 reads its row while waiting for the gateway's world size."""


@dataclass(frozen=True)
class Bucket:
    """One `/update_weights_from_distributed` call's worth of tensors."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"names": self.names, "dtypes": self.dtypes, "shapes": self.shapes}


def plan_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """Split `state` (in its order) into buckets of at most `bucket_bytes` each; a tensor
    larger than that gets a bucket of its own."""
    buckets: list[Bucket] = []
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if names and size + nbytes > bucket_bytes:
            buckets.append(Bucket(names, dtypes, shapes, size))
            names, dtypes, shapes, size = [], [], [], 0
        names.append(name)
        dtypes.append(str(tensor.dtype).removeprefix("torch."))
        shapes.append(list(tensor.shape))
        size += nbytes
    if names:
        buckets.append(Bucket(names, dtypes, shapes, size))
    return buckets


def advertised_address(configured: str | None) -> str:
    """Where the backends reach rank 0's TCPStore: the configured address, else
    torchrun's MASTER_ADDR, else this host's name resolved."""
    if configured:
        return configured
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    return socket.gethostbyname(socket.gethostname())


def join_as_rank0(
    tcp: dist.Store, name: str, world: int, backend: str, timeout: datetime.timedelta
) -> tuple[dist.ProcessGroup, torch.device]:
    """Rank 0's member of weight-update group `name` (and the device its tensors go
    from), on the store layout SGLang's side uses (`weight_group_store_prefixes`: the
    prefixes of its `init_custom_process_group`), so SGLang servers and the local engine
    find it. A bare process group rather than torch's `_new_process_group_helper`: that
    helper registers the group in torch's global state and, beside an FSDP default group
    bound to a device, would split the new NCCL group from it, a group SGLang is not in.
    Blocks until all `world` ranks joined."""
    store = tcp
    for prefix in weight_group_store_prefixes(name, backend):
        store = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        group: dist.ProcessGroup = dist.ProcessGroupNCCL(store, 0, world)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        group = dist.ProcessGroupGloo(store, 0, world, timeout)
        device = torch.device("cpu")
    group._set_sequence_number_for_group()  # as torch's helper does on SGLang's side
    return group, device


@dataclass
class _HeldGroup:
    """The group rank 0 keeps between publishes while the gateway reuses it."""

    name: str
    world_size: int
    group: dist.ProcessGroup
    tcp: dist.TCPStore
    device: torch.device

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except RuntimeError as exc:  # a peer already tore it down
                log.debug("shutdown of %s: %s", self.name, exc)


class WeightBroadcaster:
    """Rank 0's sender: `offer()` builds the row's `sync` metadata, `send()` waits for
    the gateway's answer and broadcasts. Keeps the last group for the next publish;
    `close()` leaves it."""

    def __init__(
        self,
        store: TrajectoryStore,
        *,
        backend: str,
        bucket_bytes: int,
        timeout_s: float,
        address: str | None = None,
    ) -> None:
        self.store = store
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.address = advertised_address(address)
        self._tcp: dist.TCPStore | None = None
        self._held: _HeldGroup | None = None

    def close(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

    def offer(
        self, version: int, state: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, Any], list[Bucket]]:
        """(`metadata.sync` for version `version`'s row, the bucket plan). Names the
        group held from the last publish (`held_group`), which the gateway reuses when
        its backends are unchanged. For a new group, starts its TCPStore now, on a port
        the OS picks, so backends that join before rank 0 learned the world size find it
        listening (a refused connection makes a TCPStore client back off ~0.6 s)."""
        buckets = plan_buckets(state, self.bucket_bytes)
        self._tcp = dist.TCPStore(
            "0.0.0.0",
            0,
            None,
            True,
            datetime.timedelta(seconds=self.timeout_s),
            wait_for_workers=False,
        )
        offer: dict[str, Any] = {
            "mode": "distributed",
            "master_address": self.address,
            "master_port": int(self._tcp.port),
            # unique per offer: SGLang refuses a group name its process already
            # registered with torch (a restarted gateway or trainer never destroyed)
            "group_name": f"areal-weights-v{version}-{secrets.token_hex(3)}",
            "backend": self.backend,
            "buckets": [b.to_json() for b in buckets],
            "expires_at": time.time() + self.timeout_s,
        }
        if self._held is not None:
            offer["held_group"] = {"name": self._held.name, "world_size": self._held.world_size}
        return offer, buckets

    def _group_for(self, offer: Mapping[str, Any], name: str, world: int) -> _HeldGroup:
        """The held group when the gateway reuses it, else a new one (the held one left)."""
        if self._held is not None and self._held.name == name:
            return self._held
        self.close()
        assert self._tcp is not None, "send() follows offer()"
        if name != offer["group_name"]:
            raise RuntimeError(
                f"the gateway answered with group {name!r}, neither the offered nor the held one"
            )
        timeout = datetime.timedelta(seconds=self.timeout_s)
        group, device = join_as_rank0(self._tcp, name, world, self.backend, timeout)
        self._held = _HeldGroup(name, world, group, self._tcp, device)
        return self._held

    def send(
        self,
        version: int,
        state: Mapping[str, torch.Tensor],
        offer: Mapping[str, Any],
        buckets: list[Bucket],
    ) -> dict[str, Any]:
        """Wait (up to the offer's expiry) for the gateway's answer (world size and
        group), join a new group as rank 0 or reuse the held one, and broadcast every
        bucket. Never raises for a missing or failed receiver: leaves the group, records
        `sync_error` on the row (the gateway then swaps from disk) and returns it; on
        success records and returns `sync_sent`."""
        t0 = time.perf_counter()
        try:
            world, name = self._wait_answer(version, offer)
            t_ready = time.perf_counter()
            held = self._group_for(offer, name, world)
            reused = held.tcp is not self._tcp
            t_joined = time.perf_counter()
            for bucket in buckets:
                for key in bucket.names:
                    tensor = state[key].to(held.device, non_blocking=True).contiguous()
                    held.group.broadcast(tensor, 0).wait()
            sent = {
                "wait_s": t_ready - t0,
                "join_s": t_joined - t_ready,
                "broadcast_s": time.perf_counter() - t_joined,
                "total_s": time.perf_counter() - t0,
                "bytes": sum(b.nbytes for b in buckets),
                "buckets": len(buckets),
                "world_size": world,
                "group": name,
                "reused_group": reused,
            }
            self.store.update_weight_version_metadata(version, {"sync_sent": sent})
            log.info(
                "broadcast v%d to %d backend rank(s): %d bytes in %d bucket(s), "
                "%.3f s (%.3f s waiting for the gateway%s)",
                version,
                world - 1,
                sent["bytes"],
                len(buckets),
                sent["total_s"],
                sent["wait_s"],
                ", group reused" if reused else "",
            )
            return {"sync_sent": sent}
        except (TimeoutError, RuntimeError, OSError) as exc:  # gloo/nccl errors are RuntimeError
            self.close()
            message = f"{type(exc).__name__}: {exc}"
            log.warning(
                "distributed sync of v%d failed (%s); the gateway swaps from disk", version, message
            )
            self.store.update_weight_version_metadata(version, {"sync_error": message})
            return {"sync_error": message}
        finally:
            self._tcp = None  # an unused new store closes its server

    def _wait_answer(self, version: int, offer: Mapping[str, Any]) -> tuple[int, str]:
        """(world size, group name) the gateway wrote on the row."""
        expires_at = float(offer["expires_at"])
        while True:
            record = self.store.get_weight_version(version)
            meta = record.metadata if record else {}
            if "sync_world_size" in meta:
                return (
                    int(meta["sync_world_size"]),
                    str(meta.get("sync_group", offer["group_name"])),
                )
            if "sync_failed" in meta:
                raise RuntimeError(f"the gateway gave up: {meta['sync_failed']}")
            if time.time() >= expires_at:
                raise TimeoutError("no gateway took the offer before it expired")
            time.sleep(POLL_S)
