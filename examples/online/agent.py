"""A long-running online agent with ONE virtual key (as OpenClaw-style runtimes keep).

Each episode it asks the gateway for a fresh session for its key (`POST /rl/sessions`
with the key itself: the previous episode ends with reason `refresh`), talks to the model
with the same key (model name `default`), and hands the transcript to the judge through
a queue (a JSONL file here; a message queue in production). It never posts a reward:
the judge, a separate process, does. A trainer running beside the gateway learns from
the judged episodes while this keeps going, and the agent picks up each new policy
version without noticing.

    python -m examples.online.agent --base-url http://127.0.0.1:8000 --api-key sk-areal-... \\
        --dataset examples/math/data/train.jsonl --queue data/online/queue.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
from openai import AsyncOpenAI

from areal_service.datasets import DatasetConfig, load_samples

log = logging.getLogger("online-agent")
ASK = "{question}\nGive the final answer on its own line as '#### <number>'."


async def run_agent(
    base_url: str,
    api_key: str,
    samples: list[dict[str, Any]],
    queue: Path,
    *,
    episodes: int | None = None,
    max_tokens: int | None = None,
) -> int:
    """Run episodes (forever when `episodes` is None); returns how many ran."""
    auth = {"authorization": f"Bearer {api_key}"}
    done = 0
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=120) as http,
        AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key) as client,
    ):
        for sample in itertools.cycle(samples):
            if episodes is not None and done >= episodes:
                break
            # Refresh: the key's previous session ends (reason `refresh`), a new one opens.
            # Each episode is its own group of one (the trainer runs with group_size 1).
            r = await http.post(
                "/rl/sessions",
                headers=auth,
                json={
                    "task_id": sample["id"],
                    "group_id": f"online-{uuid4().hex}",
                    "metadata": {"sample_id": sample["id"]},
                },
            )
            r.raise_for_status()
            session_id = r.json()["session_id"]
            extra = {"max_tokens": max_tokens} if max_tokens else {}
            reply = await client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": ASK.format(question=sample["question"])}],
                **extra,
            )
            with queue.open("a") as f:  # one line per episode, appended whole
                f.write(
                    json.dumps(
                        {
                            "session_id": session_id,
                            "sample_id": sample["id"],
                            "reply": reply.choices[0].message.content,
                        }
                    )
                    + "\n"
                )
            done += 1
    return done


def main() -> None:
    """Command line."""
    parser = argparse.ArgumentParser(description="long-running online agent")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", required=True, help="a virtual key (keys create)")
    parser.add_argument("--dataset", type=Path, default=Path("examples/math/data/train.jsonl"))
    parser.add_argument("--queue", type=Path, default=Path("data/online/queue.jsonl"))
    parser.add_argument("--episodes", type=int, default=None, help="default: run forever")
    parser.add_argument("--max-tokens", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.queue.parent.mkdir(parents=True, exist_ok=True)
    samples = load_samples(DatasetConfig(path=args.dataset))
    ran = asyncio.run(
        run_agent(
            args.base_url,
            args.api_key,
            samples,
            args.queue,
            episodes=args.episodes,
            max_tokens=args.max_tokens,
        )
    )
    log.info("ran %d episodes", ran)


if __name__ == "__main__":
    main()
