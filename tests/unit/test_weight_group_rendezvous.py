"""The trainer's rank 0 meets a weight-update group member built the way SGLang builds
its own (`init_custom_process_group` in `sglang/srt/utils/common.py`: torch's tcp://
rendezvous, `PrefixStore(group_name)`, then torch's `_new_process_group_helper`, which
adds `<group_name>/` and `cpu/`), in a process of its own, and broadcasts to it. Runs
without SGLang installed, so a torch release that moves the helper's keys shows here;
`tests/integration/test_sglang_engine.py` checks the real server."""

from __future__ import annotations

import datetime
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from trainer.weight_broadcast import join_as_rank0

pytestmark = pytest.mark.processes

SGLANG_MEMBER = textwrap.dedent(
    """
    import datetime, os, sys
    import torch, torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        Backend, PrefixStore, _new_process_group_helper, _world, rendezvous,
    )
    port, rank, world, name = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    timeout = datetime.timedelta(seconds=30)
    # SGLang 0.5.23's init_custom_process_group(backend="gloo", init_method=tcp://...)
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", rank, world, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(name, store)
    pg, _ = _new_process_group_helper(
        world, rank, [], Backend("gloo"), store, group_name=name,
        backend_options=None, timeout=timeout, device_id=None,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    # receive_weights_from_distributed: torch.distributed.broadcast(src=0, group=pg)
    t = torch.zeros(3)
    dist.broadcast(t, src=0, group=pg)
    print(t.tolist(), flush=True)
    # A server keeps its group for life; this stand-in leaves without tearing it down:
    # gloo's threads meeting the interpreter's teardown once aborted a member
    # ("terminate called without an active exception", exit -6) after a good broadcast.
    os._exit(0)
    """
)


def test_rank_zero_meets_members_built_like_sglangs_own_group() -> None:
    timeout = datetime.timedelta(seconds=30)
    tcp = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    members = [
        subprocess.Popen(
            [sys.executable, "-c", SGLANG_MEMBER, str(tcp.port), str(rank), "3", "areal-v1"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (1, 2)
    ]
    try:
        group, device = join_as_rank0(tcp, "areal-v1", 3, "gloo", timeout)
        assert device == torch.device("cpu")
        group.broadcast(torch.tensor([1.0, 2.0, 3.0]), 0).wait()
        for member in members:
            out, _ = member.communicate(timeout=60)
            assert member.returncode == 0
            assert out.strip() == "[1.0, 2.0, 3.0]"
    finally:
        for member in members:
            if member.poll() is None:
                member.kill()
                member.wait()
