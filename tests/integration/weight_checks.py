"""What the weight-sync tests compare: an engine's greedy continuation of one prompt
(ids, logprobs, the version it reports) and a checkpoint's tensors; and the wait for a
version to go live."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from safetensors.torch import load_file

from areal_service.store import TrajectoryStore
from areal_service.types import WeightVersionRecord

PROMPT = [5, 17, 42, 9, 3, 28, 11]


def greedy(engine: str, max_new_tokens: int = 12) -> tuple[list[int], list[float], str]:
    """(output ids, their logprobs, weight_version) of a greedy `/generate` of PROMPT."""
    reply = httpx.post(f"{engine}/generate", json={
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                            "ignore_eos": True}}, timeout=60).json()
    meta = reply["meta_info"]
    return reply["output_ids"], [t[0] for t in meta["output_token_logprobs"]], meta["weight_version"]


def variant_state(variant: Path) -> dict:
    """Every tensor of the checkpoint directory `variant`."""
    state: dict = {}
    for f in sorted(variant.glob("*.safetensors")):
        state.update(load_file(f))
    return state


def wait_live(store: TrajectoryStore, version: int, timeout_s: float = 60
              ) -> WeightVersionRecord:
    """The version's row once the weight syncer recorded its swap (`swap_mode`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        row = store.get_weight_version(version)
        if row is not None and "swap_mode" in row.metadata:
            return row
        assert time.monotonic() < deadline, f"v{version} never went live"
        time.sleep(0.01)
