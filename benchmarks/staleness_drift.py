"""How far off-policy an episode gets per version it waits: the measurement behind
`trainer.max_train_staleness` (docs/episodes-and-rewards.md, "How stale an episode may
train").

A finished run's store holds every sampled token with its behaviour logprob and the
version that sampled it; its newest published weights are what a trainer would train a
late episode with. For completions sampled k versions before the newest, this computes
what the decoupled-PPO loss would see if they were trained now, with pi_prox = the newest
weights: per token l = log pi_prox - log pi_behave, and per staleness bucket

- `k3`: mean exp(l) - 1 - l (the step line's `mismatch`, KL(pi_behave || pi_prox));
- `capped`: the share of tokens whose behaviour weight exp(l) exceeds
  `trainer.behav_imp_weight_cap` (5): the correction masks them out of the loss;
- `low`: the share with exp(l) < 1/cap (tokens the new policy has all but given up).

    python -m benchmarks.staleness_drift --data-dir data [--per-bucket 64]

Cost: one forward pass of the newest model per sampled completion (CPU is fine).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from areal_service.config import load_config
from areal_service.store import TrajectoryStore
from areal_service.types import CompletionRecord

BUCKETS = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 10**9))


def bucket_of(k: int) -> str:
    for lo, hi in BUCKETS:
        if lo <= k <= hi:
            return str(lo) if lo == hi else (f"{lo}-{hi}" if hi < 10**9 else f">={lo}")
    return "?"


def token_log_ratios(model: torch.nn.Module, c: CompletionRecord) -> list[float]:
    """l_t = log pi_prox(token) - behaviour logprob, for each output token of `c`."""
    ids = torch.tensor([list(c.prompt_ids) + list(c.output_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1].float() / c.temperature
    logp = torch.log_softmax(logits, dim=-1)
    out = torch.tensor(c.output_ids)
    prox = logp.gather(1, out[:, None])[:, 0]
    return (prox - torch.tensor(c.output_logprobs)).tolist()


def measure(data_dir: Path, per_bucket: int, cap: float, seed: int = 0) -> dict[str, object]:
    config = load_config(overrides=[f"data_dir={data_dir}"])
    store = TrajectoryStore.open(config.database_url(), config.store)
    try:
        latest = store.latest_weight_version()
        assert latest is not None, f"no published version in {data_dir}"
        ids = [s.id for s in store.list_sessions(limit=1_000_000)]
        completions = [
            c for cs in store.load_completions(ids, with_json=False).values() for c in cs
        ]
    finally:
        store.close()
    newest = latest.version
    by_bucket: dict[str, list[CompletionRecord]] = defaultdict(list)
    for c in completions:
        if c.output_ids and c.output_versions and len(c.output_logprobs) == len(c.output_ids):
            by_bucket[bucket_of(newest - min(c.output_versions))].append(c)
    model = AutoModelForCausalLM.from_pretrained(
        config.weights_dir() / f"v{newest}", dtype=torch.float32
    ).eval()
    rng = random.Random(seed)
    rows = {}
    for name in [bucket_of(lo) for lo, _ in BUCKETS]:
        chosen = by_bucket.get(name, [])
        chosen = rng.sample(chosen, min(per_bucket, len(chosen)))
        ls = [x for c in chosen for x in token_log_ratios(model, c)]
        if not ls:
            continue
        rows[name] = {
            "completions": len(chosen),
            "tokens": len(ls),
            "k3": sum(math.exp(x) - 1 - x for x in ls) / len(ls),
            "capped": sum(x > math.log(cap) for x in ls) / len(ls),
            "low": sum(x < -math.log(cap) for x in ls) / len(ls),
        }
    return {"newest_version": newest, "cap": cap, "buckets": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--per-bucket", type=int, default=64)
    parser.add_argument("--cap", type=float, default=5.0, help="trainer.behav_imp_weight_cap")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args.data_dir, args.per_bucket, args.cap)
    print(f"newest version v{result['newest_version']}, cap {result['cap']}")
    print(f"{'staleness':>10} {'compl.':>7} {'tokens':>7} {'k3':>8} {'capped':>8} {'low':>8}")
    for name, r in result["buckets"].items():  # type: ignore[attr-defined]
        print(
            f"{name:>10} {r['completions']:>7} {r['tokens']:>7} {r['k3']:>8.4f} "
            f"{r['capped']:>8.3%} {r['low']:>8.3%}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
