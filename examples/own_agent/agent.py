"""Your own agent, trained while it runs: an OpenAI Agents SDK agent against a running
`areal-service serve` (which trains), with ONE virtual key, on a task it can check
itself (single-digit addition: 60 pairs trained, 40 held out, as in the SmolLM2 demo).

    areal-service serve --model smollm2-135m-instruct --set trainer.lr=1e-5
    KEY=$(areal-service keys create --name adder | jq -r .api_key)
    python -m examples.own_agent.agent --api-key "$KEY" --minutes 20

1. measures the agent's held-out accuracy (greedy) with the admin key: turns outside any
   session, so the evaluation itself is never trained on;
2. runs episodes for `--minutes`: per train question a GRPO group of `--group-size`
   attempts, each a fresh session of the key (`POST /rl/sessions` with the key itself,
   `group_id` and `task_id`; the previous episode ends with reason `refresh`), the agent
   run once, the reward posted over REST (`POST /v1/rewards`, `end_session`);
3. reads every episode's fate back with the same key (`GET /rl/sessions/{id}`: `trained`,
   or `dropped` with its `drop_reason`), and keeps at most `--in-flight` groups waiting
   for the trainer, so it never runs ahead into stale episodes;
4. measures the held-out accuracy again (after the live version moved) and prints both.

A key holds one episode at a time, so one copy of the agent sends one request at a time.
`--copies N` runs N copies side by side, as a deployment runs several agent processes:
the first with `--api-key`, each other with a key of its own made with the admin key
(`POST /admin/keys`). The engine batches their requests, so N copies collect about N
times the episodes in the same time on a CPU.

The console (`/console`, the admin key) plots the reward per trainer step meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

from areal_service.rewards import numeric_reward

MODEL = "areal-policy"
INSTRUCTIONS = "You add numbers. Reply with the sum only."
MAX_TOKENS = 16
"""Enough for a sum; the tiny and small models often never emit EOS on their own."""
SETTLED = ("trained", "dropped")


@dataclass(frozen=True)
class Question:
    task_id: str
    text: str
    answer: str


def questions(seed: int = 0) -> tuple[list[Question], list[Question]]:
    """(60 trained, 40 held-out) single-digit additions, shuffled with `seed`."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    made = [
        Question(f"add-{a}-{b}", f"What is {a} + {b}? Answer with the number only.", str(a + b))
        for a, b in pairs
    ]
    return made[:60], made[60:]


def make_agent(client: AsyncOpenAI, temperature: float | None) -> Agent:
    """The agent as its author writes it; only the client points at the gateway."""
    return Agent(
        name="adder",
        instructions=INSTRUCTIONS,
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=temperature),
    )


async def answer(agent: Agent, question: Question) -> float:
    """Run the agent once; 1.0 when its reply's last number is the sum."""
    result = await Runner.run(agent, question.text, max_turns=1)
    return numeric_reward(str(result.final_output), {"answer": question.answer})


async def held_out_accuracy(base_url: str, admin_key: str, held_out: list[Question]) -> float:
    """Greedy accuracy over `held_out` with the admin key (no session: not trained on)."""
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key=admin_key) as client:
        agent = make_agent(client, temperature=0.0)
        scores = await asyncio.gather(*(answer(agent, q) for q in held_out))
    return statistics.fmean(scores)


class Episodes:
    """The key's episodes: sessions opened by refresh, rewards posted, fates read back."""

    def __init__(self, base_url: str, api_key: str, group_size: int, in_flight: int) -> None:
        self.http = httpx.AsyncClient(
            base_url=base_url, headers={"authorization": f"Bearer {api_key}"}, timeout=120
        )
        self.client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key)
        # No temperature: a session's turns sample at the training temperature.
        self.agent = make_agent(self.client, temperature=None)
        self.group_size = group_size
        self.in_flight = in_flight
        self.waiting: deque[list[str]] = deque()
        self.rewards: list[float] = []
        self.fates: Counter[str] = Counter()

    async def aclose(self) -> None:
        await self.client.close()
        await self.http.aclose()

    async def run_group(self, question: Question) -> None:
        """`group_size` attempts at `question`, one session each, in one GRPO group."""
        group_id = f"grp_{uuid.uuid4().hex}"
        sessions = []
        for _ in range(self.group_size):
            started = await self.http.post(
                "/rl/sessions", json={"group_id": group_id, "task_id": question.task_id}
            )
            if started.status_code == 429:  # a staleness gate is on and its window is full
                await asyncio.sleep(float(started.headers.get("retry-after", "1")))
                continue
            started.raise_for_status()
            session_id = started.json()["session_id"]
            reward = await answer(self.agent, question)
            posted = await self.http.post(
                "/v1/rewards", json={"session_id": session_id, "value": reward, "end_session": True}
            )
            posted.raise_for_status()
            sessions.append(session_id)
            self.rewards.append(reward)
        self.waiting.append(sessions)
        while len(self.waiting) > self.in_flight:
            await self.settle(self.waiting.popleft())

    async def settle(self, sessions: list[str], timeout_s: float = 300.0) -> None:
        """Wait until the trainer decided about each of `sessions`; count the fates."""
        deadline = time.monotonic() + timeout_s
        for session_id in sessions:
            while True:
                shown = (await self.http.get(f"/rl/sessions/{session_id}")).json()
                if shown["status"] in SETTLED or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            reason = shown.get("drop_reason") or ""
            self.fates[shown["status"] + (f" ({reason.split(':')[0]})" if reason else "")] += 1


async def live_version(base_url: str, admin_key: str) -> int:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        r = await http.get("/admin/status", headers={"authorization": f"Bearer {admin_key}"})
        r.raise_for_status()
        return int(r.json()["live_version"])


async def more_keys(base_url: str, admin_key: str, n: int) -> list[str]:
    """`n` more virtual keys, for the other copies of the agent."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        made = [
            await http.post(
                "/admin/keys",
                headers={"authorization": f"Bearer {admin_key}"},
                json={"name": f"adder-copy-{i + 2}"},
            )
            for i in range(n)
        ]
    for r in made:
        r.raise_for_status()
    return [r.json()["api_key"] for r in made]


async def work(
    episodes: Episodes, train: list[Question], deadline: float, show: Callable[[], Awaitable[None]]
) -> None:
    """One copy of the agent: groups until `deadline`, then every episode's fate."""
    for question in itertools.cycle(train):
        if time.monotonic() > deadline:
            break
        await episodes.run_group(question)
        await show()
    while episodes.waiting:  # every episode's fate, before the final measurement
        await episodes.settle(episodes.waiting.popleft())


async def main(args: argparse.Namespace) -> dict[str, object]:
    set_tracing_disabled(True)  # tracing would upload to api.openai.com with our key
    admin_key = args.admin_key or Path(args.admin_key_file).read_text().strip()
    train, held_out = questions()
    start_version = await live_version(args.base_url, admin_key)
    before = await held_out_accuracy(args.base_url, admin_key, held_out)
    print(f"held-out accuracy (greedy) at v{start_version}: {before:.3f}", flush=True)
    keys = [args.api_key, *await more_keys(args.base_url, admin_key, args.copies - 1)]
    copies = [Episodes(args.base_url, k, args.group_size, args.in_flight) for k in keys]
    started = time.monotonic()
    next_report = started + 30

    async def show() -> None:
        nonlocal next_report
        if time.monotonic() < next_report:
            return
        next_report = time.monotonic() + 30
        rewards = [r for c in copies for r in c.rewards]
        fates = sum((c.fates for c in copies), Counter[str]())
        version = await live_version(args.base_url, admin_key)
        print(
            f"[{time.monotonic() - started:5.0f}s] v{version}  episodes {len(rewards)}  "
            f"recent reward {statistics.fmean(rewards[-64:]):.3f}  fates {dict(fates)}",
            flush=True,
        )

    deadline = started + args.minutes * 60
    try:
        # Each copy starts at another question, so the copies' groups differ.
        await asyncio.gather(
            *(work(c, train[i :: len(copies)], deadline, show) for i, c in enumerate(copies))
        )
    finally:
        for c in copies:
            await c.aclose()
    rewards = [r for c in copies for r in c.rewards]
    fates = sum((c.fates for c in copies), Counter[str]())
    await asyncio.sleep(args.swap_wait_s)  # the last published version is swapped in
    end_version = await live_version(args.base_url, admin_key)
    after = await held_out_accuracy(args.base_url, admin_key, held_out)
    print(f"held-out accuracy (greedy) at v{end_version}: {after:.3f}", flush=True)
    summary = {
        "before": before,
        "after": after,
        "start_version": start_version,
        "end_version": end_version,
        "episodes": len(rewards),
        "fates": dict(fates),
        "minutes": (time.monotonic() - started) / 60,
    }
    print(json.dumps(summary), flush=True)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--api-key", required=True, help="A virtual key (`keys create`): the first copy's."
    )
    parser.add_argument("--admin-key", default=None, help="For the held-out evaluation.")
    parser.add_argument(
        "--admin-key-file", default="data/admin_key", help="Where serve keeps the admin key."
    )
    parser.add_argument("--minutes", type=float, default=20.0, help="Training time.")
    parser.add_argument(
        "--group-size", type=int, default=4, help="Attempts per question (trainer.group_size)."
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        default=2,
        help="Groups per copy waiting for the trainer before it waits for their fate.",
    )
    parser.add_argument(
        "--copies", type=int, default=4, help="Copies of the agent side by side (one key each)."
    )
    parser.add_argument("--swap-wait-s", type=float, default=10.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
