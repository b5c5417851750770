"""The judge of the online example: a separate process that reads finished episodes
from the agent's queue, scores them with math-verify against the dataset's answers, and
posts each reward over `POST /v1/rewards` with the admin key. Reward ids are derived
from the session id, so a restarted judge re-reading the queue posts nothing twice.

    python -m examples.online.judge --base-url http://127.0.0.1:8000 --data-dir data/online \\
        --dataset examples/math/data/train.jsonl --queue data/online/queue.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import httpx

from areal_service.datasets import DatasetConfig, load_samples
from areal_service.rewards import math_reward

log = logging.getLogger("online-judge")


async def judge(
    base_url: str,
    admin_key: str,
    samples: dict[str, dict[str, Any]],
    queue: Path,
    *,
    stop_after: int | None = None,
    poll_s: float = 0.2,
) -> int:
    """Score queued episodes as they appear (until `stop_after` were posted, else
    forever); returns how many rewards were posted."""
    auth = {"authorization": f"Bearer {admin_key}"}
    posted, offset = 0, 0
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        while stop_after is None or posted < stop_after:
            lines = queue.read_text().splitlines(keepends=True) if queue.exists() else []
            fresh = [ln for ln in lines[offset:] if ln.endswith("\n")]  # whole lines only
            offset += len(fresh)
            for line in fresh:
                episode = json.loads(line)
                value = math_reward(episode["reply"], samples[episode["sample_id"]])
                r = await http.post(
                    "/v1/rewards",
                    headers=auth,
                    json={
                        "id": f"judge-{episode['session_id']}",
                        "session_id": episode["session_id"],
                        "value": value,
                        "metadata": {"judge": "math-verify"},
                    },
                )
                if r.status_code == 409:  # already trained or scored with another value
                    log.warning("reward for %s refused: %s", episode["session_id"], r.text)
                else:
                    r.raise_for_status()
                posted += 1
            if not fresh:
                await asyncio.sleep(poll_s)
    return posted


def main() -> None:
    """Command line."""
    parser = argparse.ArgumentParser(description="judge of the online example")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--admin-key", default=None, help="default: the key the gateway generated in --data-dir"
    )
    parser.add_argument("--data-dir", type=Path, default=Path("data/online"))
    parser.add_argument("--dataset", type=Path, default=Path("examples/math/data/train.jsonl"))
    parser.add_argument("--queue", type=Path, default=Path("data/online/queue.jsonl"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    # On loopback the gateway generates its admin key once per data dir (0600 file).
    admin_key = args.admin_key or (args.data_dir / "admin_key").read_text().strip()
    samples = {s["id"]: s for s in load_samples(DatasetConfig(path=args.dataset))}
    asyncio.run(judge(args.base_url, admin_key, samples, args.queue))


if __name__ == "__main__":
    main()
