"""A solver and a reviewer in one episode, each on its own LoRA adapter (policies
`solver` and `reviewer`, picked by the model names `solver-model` and `reviewer-model`).

The solver answers a single-digit addition. The reviewer is shown the solver's proposed
answer and writes the final answer: it may keep the proposal or correct it. The
episode's reward is the solver's correctness; the reviewer's role is rewarded for a
correct final answer (`role_rewards`). The gateway records the reviewer's completions in
the episode's role sub-session, so each policy's trainer trains on its own role. Plain
OpenAI SDK calls with a session key; rewards over REST.

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
REVIEWER_MODEL = "reviewer-model"
_NUMBER = re.compile(r"-?\d+")


@dataclass(frozen=True, slots=True)
class Question:
    a: int
    b: int

    @property
    def text(self) -> str:
        return f"What is {self.a} + {self.b}? Answer with the number only."

    @property
    def answer(self) -> int:
        return self.a + self.b

    def review_text(self, proposal: str) -> str:
        """The reviewer's prompt: the question with the solver's proposed answer."""
        return (
            f"What is {self.a} + {self.b}? Someone answered {proposal}. "
            "Check it and give the correct answer with the number only."
        )


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


@dataclass(frozen=True, slots=True)
class Proposal:
    """An answer for the reviewer to review: `text` proposed for `question`."""

    question: Question
    text: str

    @property
    def right(self) -> bool:
        return self.text == str(self.question.answer)


@dataclass(frozen=True, slots=True)
class Outcome:
    solver: float
    reviewer: float
    copied: bool
    """The reviewer's final answer is the solver's proposal (right or wrong)."""


@dataclass(frozen=True, slots=True)
class Review:
    """The reviewer's greedy final answer to one proposal."""

    proposal: Proposal
    final: int | None

    @property
    def correct(self) -> bool:
        return self.final == self.proposal.question.answer

    @property
    def copied(self) -> bool:
        return str(self.final) == self.proposal.text


def review_scores(reviews: list[Review], prefix: str) -> dict[str, float]:
    """`prefix`: the reviewer's final-answer accuracy over `reviews`; `prefix_right` and
    `prefix_wrong`: on the right and on the wrong proposals (0.0 where there are none);
    `prefix_balanced`, their mean (a reviewer that copies every proposal scores 0.5);
    `prefix_copied_wrong`, how often it copied a wrong proposal."""
    right = [float(r.correct) for r in reviews if r.proposal.right]
    wrong = [r for r in reviews if not r.proposal.right]
    on_wrong = statistics.fmean(float(r.correct) for r in wrong) if wrong else 0.0
    on_right = statistics.fmean(right) if right else 0.0
    return {
        prefix: statistics.fmean(float(r.correct) for r in reviews),
        f"{prefix}_right": on_right,
        f"{prefix}_wrong": on_wrong,
        f"{prefix}_balanced": (on_right + on_wrong) / 2,
        f"{prefix}_copied_wrong": (
            statistics.fmean(float(r.copied) for r in wrong) if wrong else 0.0
        ),
    }


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
        content: str | None = reply.choices[0].message.content
        return content

    async def episode(self, session: dict[str, Any], q: Question) -> Outcome:
        """Solver turn, reviewer turn, then the episode's reward with the reviewer's own."""
        key = session["api_key"]
        answer = last_number(await self._ask(key, SOLVER_MODEL, q.text, 16, None))
        proposal = "nothing" if answer is None else str(answer)
        final = last_number(await self._ask(key, REVIEWER_MODEL, q.review_text(proposal), 16, None))
        outcome = Outcome(
            float(answer == q.answer), float(final == q.answer), str(final) == proposal
        )
        posted = await self.http.post(
            "/v1/rewards",
            headers={"authorization": f"Bearer {key}"},
            json={
                "session_id": session["session_id"],
                "value": outcome.solver,
                "role_rewards": {"reviewer": outcome.reviewer},
                "end_session": True,
            },
        )
        posted.raise_for_status()
        return outcome

    async def group(self, q: Question, group_size: int) -> list[Outcome]:
        """One GRPO group of the question: `group_size` episodes, opened by the admin
        (the episodes' own policy is the solver; the reviewer joins as a role)."""
        started = await self.http.post(
            "/rl/sessions",
            headers={"authorization": f"Bearer {self.admin_key}"},
            json={"group_size": group_size, "policy": "solver", "task_id": f"add-{q.a}-{q.b}"},
        )
        started.raise_for_status()
        return list(await asyncio.gather(*(self.episode(s, q) for s in started.json()["sessions"])))

    async def solver_proposals(self, held_out: list[Question], samples: int = 4) -> list[Proposal]:
        """The solver's own answers to the held-out questions, sampled at T=1 outside any
        session: what the reviewer is evaluated on (taken once, before training, so the
        before and after evaluations review the same proposals)."""

        async def one(q: Question) -> Proposal:
            answer = last_number(await self._ask(self.admin_key, SOLVER_MODEL, q.text, 16, 1.0))
            return Proposal(q, "nothing" if answer is None else str(answer))

        return list(await asyncio.gather(*(one(q) for q in held_out for _ in range(samples))))

    async def evaluate(
        self, held_out: list[Question], proposals: list[Proposal] | None = None, seed: int = 0
    ) -> dict[str, float]:
        """Greedy held-out scores of each role, outside any session (nothing trained):
        `solver`, its accuracy on the questions; `near_miss*`, the reviewer's on one right
        proposal and one off by 1 or 2 per question (see `review_scores`); with
        `proposals`, `proposals*`, the reviewer's on those, and `proposals_right_share`,
        the share of them that are right."""
        rng = random.Random(seed)

        async def solve(q: Question) -> float:
            reply = await self._ask(self.admin_key, SOLVER_MODEL, q.text, 16, 0.0)
            return float(last_number(reply) == q.answer)

        async def review(p: Proposal) -> Review:
            reply = await self._ask(
                self.admin_key, REVIEWER_MODEL, p.question.review_text(p.text), 16, 0.0
            )
            return Review(p, last_number(reply))

        near = [Proposal(q, str(q.answer)) for q in held_out] + [
            Proposal(q, str(q.answer + rng.choice((-2, -1, 1, 2)))) for q in held_out
        ]
        solver = await asyncio.gather(*(solve(q) for q in held_out))
        scores = {
            "solver": statistics.fmean(solver),
            **review_scores(list(await asyncio.gather(*map(review, near))), "near_miss"),
        }
        if proposals:
            reviews = list(await asyncio.gather(*map(review, proposals)))
            scores |= review_scores(reviews, "proposals")
            scores["proposals_right_share"] = statistics.fmean(float(p.right) for p in proposals)
        return scores


async def _main(args: argparse.Namespace) -> None:
    train, held_out = split()
    agent = MultiAgent(args.base_url, args.admin_key)
    try:
        if args.eval:
            print(await agent.evaluate(held_out, await agent.solver_proposals(held_out)))
            return
        for i in range(args.groups):
            outcomes = await agent.group(train[i % len(train)], args.group_size)
            print(
                f"group {i + 1}/{args.groups}: solver "
                f"{statistics.fmean(o.solver for o in outcomes):.2f}, reviewer "
                f"{statistics.fmean(o.reviewer for o in outcomes):.2f} "
                f"(copied {sum(o.copied for o in outcomes)}/{len(outcomes)})"
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
