"""A solver and a verifier in one episode, each on its own LoRA adapter (policies
`solver` and `verifier`, picked by the model names `solver-model` and `verifier-model`).

The solver answers a single-digit addition; the verifier is asked whether the solver's
answer is right. The episode's reward is the solver's correctness; the verifier's role
is rewarded for a correct judgement (`role_rewards`). The gateway records the verifier's
completions in the episode's role sub-session, so each policy's trainer trains on its
own role. Plain OpenAI SDK calls with a session key; rewards over REST.

    python -m examples.multi_agent.agent --base-url http://127.0.0.1:8000 \\
        --admin-key "$AREAL_ADMIN_KEY" --groups 64        # train (trainers running)
    python -m examples.multi_agent.agent ... --eval       # held-out evaluation only
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from launcher.demo_task import addition_task

SOLVER_MODEL = "solver-model"
VERIFIER_MODEL = "verifier-model"
_NUMBER = re.compile(r"-?\d+")
_VERDICT = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Question:
    a: int
    b: int

    @property
    def text(self) -> str:
        return f"What is {self.a} + {self.b}? Answer with the number only."

    def judge_text(self, claim: str) -> str:
        """The verifier's question about the claimed answer `claim`."""
        return f"Is {self.a} + {self.b} = {claim}? Answer yes or no."


def split(seed: int = 0) -> tuple[list[Question], list[Question]]:
    """The demo's addition split: 60 trained single-digit pairs, 40 held out."""
    task = addition_task(seed)

    def of(task_id: str) -> Question:
        _, a, b = task_id.split("-")
        return Question(int(a), int(b))

    return [of(p.task_id) for p in task.train], [of(p.task_id) for p in task.evals[0].prompts]


def last_number(reply: str | None) -> int | None:
    found = _NUMBER.findall(reply or "")
    return int(found[-1]) if found else None


def verdict(reply: str | None) -> bool | None:
    """The verifier's first yes/no (None: neither)."""
    found = _VERDICT.search(reply or "")
    return None if found is None else found.group(1).lower() == "yes"


@dataclass(frozen=True, slots=True)
class Claim:
    """An answer for the verifier to judge: `text` claimed for `question`."""

    question: Question
    text: str
    right: bool


@dataclass(frozen=True, slots=True)
class Outcome:
    solver: float
    verifier: float


class MultiAgent:
    """The agent against one gateway: `base_url` (no `/v1`) and its admin key."""

    def __init__(self, base_url: str, admin_key: str, *, timeout_s: float = 300) -> None:
        self.base_url = base_url
        self.admin_key = admin_key
        self.http = httpx.AsyncClient(base_url=base_url, timeout=timeout_s)
        self.client = openai.AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key=admin_key, max_retries=5, timeout=timeout_s
        )

    async def aclose(self) -> None:
        await self.client.close()
        await self.http.aclose()

    async def _ask(
        self, key: str, model: str, text: str, max_tokens: int, temperature: float | None
    ) -> str | None:
        extra: dict[str, Any] = {} if temperature is None else {"temperature": temperature}
        reply = await self.client.with_options(api_key=key).chat.completions.create(
            model=model,
            max_tokens=max_tokens,
            messages=[{"role": "user", "content": text}],
            **extra,
        )
        return reply.choices[0].message.content

    async def episode(self, session: dict[str, Any], q: Question) -> Outcome:
        """Solver turn, verifier turn, then the episode's reward with the verifier's own."""
        key = session["api_key"]
        answer = last_number(await self._ask(key, SOLVER_MODEL, q.text, 16, None))
        claim = "nothing" if answer is None else str(answer)
        judged = verdict(await self._ask(key, VERIFIER_MODEL, q.judge_text(claim), 4, None))
        right = answer == q.a + q.b
        outcome = Outcome(float(right), float(judged is not None and judged == right))
        posted = await self.http.post(
            "/v1/rewards",
            headers={"authorization": f"Bearer {key}"},
            json={
                "session_id": session["session_id"],
                "value": outcome.solver,
                "role_rewards": {"verifier": outcome.verifier},
                "end_session": True,
            },
        )
        posted.raise_for_status()
        return outcome

    async def group(self, q: Question, group_size: int) -> list[Outcome]:
        """One GRPO group of the question: `group_size` episodes, opened by the admin
        (the episodes' own policy is the solver; the verifier joins as a role)."""
        started = await self.http.post(
            "/rl/sessions",
            headers={"authorization": f"Bearer {self.admin_key}"},
            json={"group_size": group_size, "policy": "solver", "task_id": f"add-{q.a}-{q.b}"},
        )
        started.raise_for_status()
        return list(await asyncio.gather(*(self.episode(s, q) for s in started.json()["sessions"])))

    async def solver_claims(self, held_out: list[Question], samples: int = 4) -> list[Claim]:
        """The solver's own answers to the held-out questions, sampled at T=1 outside any
        session: what the verifier is evaluated on (taken once, before training, so the
        before and after evaluations judge the same claims)."""

        async def one(q: Question) -> Claim:
            reply = await self._ask(self.admin_key, SOLVER_MODEL, q.text, 16, 1.0)
            answer = last_number(reply)
            return Claim(q, "nothing" if answer is None else str(answer), answer == q.a + q.b)

        return list(await asyncio.gather(*(one(q) for q in held_out for _ in range(samples))))

    async def evaluate(
        self, held_out: list[Question], claims: list[Claim] | None = None, seed: int = 0
    ) -> dict[str, float]:
        """Greedy held-out scores of each role, outside any session (nothing trained):
        `solver`, its accuracy on the questions; `verifier_near_miss`, the verifier's
        accuracy on one right claim and one off by 1 or 2 per question; with `claims`,
        `verifier`, its balanced accuracy (the mean of its accuracy on the right claims
        and on the wrong ones: always "yes" or always "no" scores 0.5) on those claims."""
        rng = random.Random(seed)

        async def solve(q: Question) -> float:
            reply = await self._ask(self.admin_key, SOLVER_MODEL, q.text, 16, 0.0)
            return float(last_number(reply) == q.a + q.b)

        async def judge(claim: Claim) -> float:
            reply = await self._ask(
                self.admin_key, VERIFIER_MODEL, claim.question.judge_text(claim.text), 4, 0.0
            )
            return float(verdict(reply) == claim.right)

        near = [Claim(q, str(q.a + q.b), True) for q in held_out] + [
            Claim(q, str(q.a + q.b + rng.choice((-2, -1, 1, 2))), False) for q in held_out
        ]
        solver = await asyncio.gather(*(solve(q) for q in held_out))
        scores = {
            "solver": statistics.fmean(solver),
            "verifier_near_miss": statistics.fmean(await asyncio.gather(*map(judge, near))),
        }
        if claims:
            judged = await asyncio.gather(*map(judge, claims))
            by_truth = [
                [j for j, c in zip(judged, claims, strict=True) if c.right == truth] or [0.0]
                for truth in (True, False)
            ]
            scores["verifier"] = statistics.fmean(statistics.fmean(s) for s in by_truth)
            scores["claims_right"] = statistics.fmean(float(c.right) for c in claims)
        return scores


async def _main(args: argparse.Namespace) -> None:
    train, held_out = split()
    agent = MultiAgent(args.base_url, args.admin_key)
    try:
        if args.eval:
            print(await agent.evaluate(held_out, await agent.solver_claims(held_out)))
            return
        for i in range(args.groups):
            outcomes = await agent.group(train[i % len(train)], args.group_size)
            print(
                f"group {i + 1}/{args.groups}: solver "
                f"{statistics.fmean(o.solver for o in outcomes):.2f}, verifier "
                f"{statistics.fmean(o.verifier for o in outcomes):.2f}"
            )
    finally:
        await agent.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--admin-key", required=True)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--eval", action="store_true")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
