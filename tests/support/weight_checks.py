"""What the weight-sync tests compare: an engine's greedy continuation of one prompt
(ids, logprobs, the version it reports) and a checkpoint's tensors; and the wait for a
version to go live."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from areal_service.store import TrajectoryStore
from areal_service.types import TrainSequence, WeightVersionRecord
from trainer.batch import build_micro_batches
from trainer.model import apply_fsdp2, destroy_distributed, init_distributed, load_policy
from trainer.step import forward_logprobs

PROMPT = [5, 17, 42, 9, 3, 28, 11]


def greedy(engine: str, max_new_tokens: int = 12) -> tuple[list[int], list[float], str]:
    """(output ids, their logprobs, weight_version) of a greedy `/generate` of PROMPT."""
    reply = httpx.post(
        f"{engine}/generate",
        json={
            "input_ids": PROMPT,
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        },
        timeout=60,
    ).json()
    meta = reply["meta_info"]
    return (
        reply["output_ids"],
        [t[0] for t in meta["output_token_logprobs"]],
        meta["weight_version"],
    )


def variant_state(variant: Path) -> dict:
    """Every tensor of the checkpoint directory `variant`."""
    state: dict = {}
    for f in sorted(variant.glob("*.safetensors")):
        state.update(load_file(f))
    return state


def wait_live(store: TrajectoryStore, version: int, timeout_s: float = 60) -> WeightVersionRecord:
    """The version's row once the weight syncer recorded its swap (`swap_mode`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        row = store.get_weight_version(version)
        if row is not None and "swap_mode" in row.metadata:
            return row
        assert time.monotonic() < deadline, f"v{version} never went live"
        time.sleep(0.01)


def served_sequence(store: TrajectoryStore, completion_id: str) -> TrainSequence:
    """A stored completion as the trainer sees it: prompt + output, the engine's
    behaviour logprobs on the output tokens."""
    c = store.get_completion(completion_id)
    n_prompt, n_out = len(c.prompt_ids), len(c.output_ids)
    return TrainSequence(
        session_id=c.session_id or "",
        group_id=None,
        completion_ids=(c.id,),
        input_ids=c.prompt_ids + c.output_ids,
        loss_mask=(0,) * n_prompt + (1,) * n_out,
        logprobs=(0.0,) * n_prompt + c.output_logprobs,
        versions=(-1,) * n_prompt + c.output_versions,
        reward=0.0,
        temperature=c.temperature,
    )


def trainer_logprobs(
    model_dir: Path, sequences: list[TrainSequence], adapter: Path | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(trainer's logprobs, engine's logprobs) of the sequences' output tokens: the
    trainer's own path (FSDP2 policy at world size 1, packed micro-batch,
    forward_logprobs) on the weights in `model_dir`, with the published LoRA `adapter`
    on them when given (PEFT, as `trainer.lora` trains it)."""
    destroy_distributed()
    init_distributed("cpu")
    try:
        policy = load_policy(model_dir)
        if adapter is not None:
            from peft import PeftModel

            policy = PeftModel.from_pretrained(policy, adapter)
        model = apply_fsdp2(policy, mixed_precision=False)
        mbs = build_micro_batches(sequences, [0.0] * len(sequences), max_tokens_per_mb=10_000)
        assert len(mbs) == 1
        with torch.no_grad():
            logp, _ = forward_logprobs(model, mbs[0])
        return logp, mbs[0].behave_logprobs
    finally:
        destroy_distributed()
