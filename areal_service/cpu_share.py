"""Cores follow the work: the local engine and a one-process trainer on one CPU host.

Each is given a share of the cores (`launcher/stack.py:share_cpus`, half each). A fixed
share wastes the other half whenever one side has nothing to do: the engine sits idle at
the staleness bound while the trainer steps, and the trainer waits for episodes while
the engine generates (and does not exist yet while the engine measures the untrained
policy). Giving both all the cores is worse: two OpenMP teams on the same cores wait at
each other's barriers (on 2 cores the trainer's step went from 10 s to 17-35 s).

So each side says whether it has work, and takes all the cores while the other says it
has none, its share otherwise. The state is one small file both map (`CpuShare.open`):
per side, a busy flag and the pid that wrote it, so a side that died busy does not keep
the other on its share. Each side re-reads it where changing its thread count is cheap
and frequent enough: the engine before each scheduler step, the trainer before each
decoder layer's forward and backward (tens of milliseconds apart), so both run on all
the cores for at most one such interval.

A remote engine (vLLM, SGLang) takes no part: its load is not visible here, so the
launcher turns this on only for the local engine.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Literal

Side = Literal["engine", "trainer"]
_SLOT = struct.Struct("<qq")  # pid, busy
_OFFSET = {"engine": 0, "trainer": _SLOT.size}
_SIZE = 2 * _SLOT.size


def host_cores() -> int:
    """The cores this process may run on (its affinity: `taskset` narrows it)."""
    return len(os.sched_getaffinity(0))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


class CpuShare:
    """One side of the shared state. `follow(busy)` records this side's state and sets
    torch's intra-op threads: all the cores while the other side is idle, `share` else."""

    def __init__(self, path: Path, side: Side, *, share: int, cores: int | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self.side = side
        self.other: Side = "trainer" if side == "engine" else "engine"
        self.share = max(1, share)
        self.cores = max(self.share, cores or host_cores())
        import torch  # here, not at import: the core package loads no torch

        self._torch = torch
        self.threads = torch.get_num_threads()
        self._busy: bool | None = None
        self.follow(False)  # this side's slot is ours now, whatever an earlier run left

    def other_busy(self) -> bool:
        """Whether the other side last said it has work (and is still alive)."""
        pid, busy = _SLOT.unpack_from(self._map, _OFFSET[self.other])
        return bool(busy) and pid > 0 and _alive(pid)

    def follow(self, busy: bool) -> int:
        """Record this side's state; set and return its thread count."""
        if busy != self._busy:
            _SLOT.pack_into(self._map, _OFFSET[self.side], os.getpid(), int(busy))
            self._busy = busy
        want = self.share if self.other_busy() else self.cores
        if want != self.threads:
            self._torch.set_num_threads(want)
            self.threads = want
        return want

    def close(self) -> None:
        """Say idle (the other side may take every core) and unmap."""
        if not self._map.closed:
            _SLOT.pack_into(self._map, _OFFSET[self.side], os.getpid(), 0)
            self._map.close()
