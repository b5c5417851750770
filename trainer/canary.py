"""The trainer's side of verified swaps: the canary's token ids (rendered once with the
served chat template) and, per published version, its teacher-forced logprobs under the
new weights (`areal_service/canary.py` for the records, `gateway/swap_verify.py` for
the check). Cost per publish: one forward pass over a few short sequences, no grad.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoTokenizer

from areal_service.canary import CanarySequence, Fingerprint
from areal_service.config import SwapVerifyConfig
from areal_service.types import WeightVersionRecord


def canary_ids(config: SwapVerifyConfig, tokenizer_dir: Path) -> list[tuple[list[int], int]]:
    """(ids, start) per canary prompt: the user message rendered with the tokenizer's chat
    template and a generation prompt (plain text when it has none), then the first
    `continuation_tokens` tokens of the continuation; `start` is where those begin."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tail = tok.encode(config.continuation, add_special_tokens=False)[: config.continuation_tokens]
    if not tail:
        raise ValueError("swap_verify.continuation encodes to no tokens")
    out = []
    for prompt in config.prompts:
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding
                ids = ids["input_ids"]
            head = [int(i) for i in ids]
        else:
            head = tok.encode(prompt)
        out.append(([*head, *tail], len(head)))
    return out


@torch.no_grad()
def score(
    model: torch.nn.Module, canary: Sequence[tuple[list[int], int]], device: torch.device
) -> list[list[float]]:
    """Every canary sequence's continuation logprobs under `model` (temperature 1, as an
    engine's prompt logprobs). Collective under FSDP2: every rank calls it. Eval mode
    for the pass (no dropout), then back to what it was."""
    was_training = model.training
    model.eval()
    try:
        out = []
        for ids, start in canary:
            x = torch.tensor([ids], dtype=torch.long, device=device)
            logits = model(input_ids=x, use_cache=False).logits[0, start - 1 : -1].float()
            logp = logits.log_softmax(-1).gather(-1, x[0, start:, None]).squeeze(-1)
            out.append([float(v) for v in logp.tolist()])
    finally:
        model.train(was_training)
    reshard = getattr(model, "reshard", None)  # FSDPModule: free the gathered root
    if reshard is not None:
        reshard()
    return out


def fingerprint(
    canary: Sequence[tuple[list[int], int]],
    logprobs: Sequence[Sequence[float]],
    previous: Sequence[Sequence[float]] | None,
    dtype: torch.dtype,
) -> Fingerprint:
    """The record published with a version (metadata `canary`)."""
    return Fingerprint(
        sequences=[
            CanarySequence(
                ids=ids,
                start=start,
                logprobs=list(lp),
                previous=list(previous[i]) if previous is not None else None,
            )
            for i, ((ids, start), lp) in enumerate(zip(canary, logprobs, strict=True))
        ],
        dtype=str(dtype).removeprefix("torch."),
    )


class CanaryTracker:
    """One run's canary: its ids (rendered once) and the logprobs of the last
    fingerprinted weights (the next fingerprint's contrast). Every rank holds one (the
    forward is collective); rank 0 publishes what it returns."""

    def __init__(
        self,
        config: SwapVerifyConfig,
        tokenizer_dir: Path,
        model: torch.nn.Module,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.canary = canary_ids(config, tokenizer_dir)
        self.device, self.dtype = device, dtype
        self.previous = score(model, self.canary, device)  # the weights training starts from

    def fingerprint(self, model: torch.nn.Module) -> dict[str, object]:
        """The fingerprint of `model`'s current weights (metadata `canary` of the version
        about to be published), with the last one's logprobs as its contrast."""
        now = score(model, self.canary, self.device)
        fp = fingerprint(self.canary, now, self.previous, self.dtype)
        self.previous = now
        return fp.model_dump()


def refusal_streak(records: Sequence[WeightVersionRecord], max_failures: int) -> str | None:
    """Why the trainer must stop, when the newest `max_failures` versions the gateway
    judged (newest first in `records`; versions not judged yet are skipped) were all
    refused by the swap canary; None otherwise."""
    judged = [r for r in records if isinstance(r.metadata.get("verify"), dict)]
    streak = judged[:max_failures]
    if len(streak) < max_failures or not all(r.metadata["verify"].get("refused") for r in streak):
        return None
    detail = "; ".join(
        f"v{r.version}: "
        + ", ".join(
            f"{url} {e.get('error') or e.get('max_abs_diff')}"
            for url, e in r.metadata["verify"].get("engines", {}).items()
            if not e.get("passed")
        )
        for r in streak
    )
    return (
        f"the gateway refused the last {max_failures} published versions of policy "
        f"{streak[0].policy} (the engines' canary logprobs differ from this trainer's by "
        f"more than {streak[0].metadata['verify'].get('tolerance')}: {detail}); stopping "
        "instead of publishing more versions nobody serves. See docs/verified-swaps.md."
    )
