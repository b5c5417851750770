"""Generate the small GSM8K-style arithmetic word-problem set shipped in `data/`.

Each row has GSM8K's columns: `question`, and `answer` = a worked solution ending in
`#### <number>`. Seeded, so rerunning reproduces the shipped files byte for byte:

    python examples/math/make_dataset.py            # writes data/train.jsonl, data/test.jsonl
    python examples/math/make_dataset.py --train 1000 --test 200 --seed 7 --out /tmp/math
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal"]
ITEMS = ["apples", "stickers", "marbles", "books", "cookies", "pencils", "shells", "cards"]

Problem = tuple[str, str, int]


def _buy(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    packs, per, price = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 9)
    total = packs * per
    cost = packs * price
    q = (
        f"{name} buys {packs} packs of {item}. Each pack has {per} {item} and costs "
        f"${price}. How many dollars does {name} spend?"
    )
    return (
        q,
        f"{name} buys {packs} packs at ${price} each, so {packs} * {price} = {cost}. "
        f"(That is {total} {item}.)",
        cost,
    )


def _share(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each, left = rng.randint(2, 8), rng.randint(2, 10), rng.randint(0, 9)
    start = friends * each + left
    q = (
        f"{name} has {start} {item} and gives {each} to each of {friends} friends. How "
        f"many {item} does {name} have left?"
    )
    given = friends * each
    return (
        q,
        f"{name} gives away {friends} * {each} = {given} {item}. {start} - {given} = {left}.",
        left,
    )


def _save(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    weekly, weeks, spent = rng.randint(3, 20), rng.randint(2, 10), rng.randint(1, 15)
    saved = weekly * weeks
    q = (
        f"{name} saves ${weekly} every week for {weeks} weeks, then spends ${spent} on a "
        f"gift. How many dollars are left?"
    )
    return (
        q,
        f"{name} saves {weekly} * {weeks} = {saved} dollars. {saved} - {spent} = {saved - spent}.",
        saved - spent,
    )


def _rows(rng: random.Random) -> Problem:
    item = rng.choice(ITEMS)
    rows, per, extra = rng.randint(2, 12), rng.randint(2, 12), rng.randint(1, 20)
    q = (
        f"A shelf has {rows} rows with {per} {item} in each row, and {extra} more {item} "
        f"on top. How many {item} are there?"
    )
    return (
        q,
        f"{rows} * {per} = {rows * per}. {rows * per} + {extra} = {rows * per + extra}.",
        rows * per + extra,
    )


KINDS: list[Callable[[random.Random], Problem]] = [_buy, _share, _save, _rows]


def make_rows(n: int, seed: int) -> list[dict[str, str]]:
    """`n` problems as GSM8K rows."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        question, work, answer = rng.choice(KINDS)(rng)
        rows.append(
            {"id": f"arith-{seed}-{i}", "question": question, "answer": f"{work}\n#### {answer}"}
        )
    return rows


def write_jsonl(rows: list[dict[str, str]], path: Path) -> None:
    """One JSON object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    """Write train.jsonl and test.jsonl."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=200)
    parser.add_argument("--test", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    args = parser.parse_args()
    write_jsonl(make_rows(args.train, args.seed), args.out / "train.jsonl")
    write_jsonl(make_rows(args.test, args.seed + 1), args.out / "test.jsonl")
    print(f"wrote {args.train} + {args.test} problems to {args.out}")


if __name__ == "__main__":
    main()
