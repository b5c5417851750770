"""`areal-service demo`: the whole loop on one machine, on the embedded default.

Starts the local engine, the gateway and the trainer as child processes (each with the
resolved config saved under `<data_dir>/demo/`), measures the untrained policy on the
synthetic task (`demo_task.py`), then runs agents that talk to the gateway through the
`openai` client — one session per episode, GRPO groups, rewards posted over REST —
while the trainer learns from them and hot-swaps weights into the engine. Ends with a
summary: baseline vs final reward (same prompts, same sampling), steps, swaps,
episodes, throughput. Ctrl-C stops every child it started, in reverse order.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx
import typer

from areal_service.config import ServiceConfig, with_admin_key
from launcher.demo_task import DemoPrompt, digits_reward, make_prompts
from launcher.launch import trainer_argv
from launcher.processes import exit_on_sigterm
from launcher.stack import Stack, local_stack, share_cpus

TARGET_REWARD = 0.9
EVAL_EPISODES = 128
MAX_TOKENS = 8


def say(message: str) -> None:
    """One progress line for the person watching."""
    typer.echo(message)


def demo_config(config: ServiceConfig, steps: int, trainer_procs: int = 1) -> ServiceConfig:
    """The demo's settings on top of the user's: a learning rate for a tiny model, GRPO
    groups of 8, the staleness gate on (η = 2), training sampling (temperature 1).
    `trainer_procs` > 1 splits the trainer's share of the cores between its processes.
    The demo serves a gateway: the data dir's admin key is created here when needed."""
    config = with_admin_key(config)
    tree = config.model_dump(mode="python")
    tree["gateway"]["admin_key"] = config.gateway.admin_key.get_secret_value()
    tree["gateway"].update(staleness_gate=True, sampling="training", admit_wait_s=30.0)
    tree["trainer"].update(lr=2e-3, group_size=8, batch_groups=4, max_staleness=2,
                           total_steps=steps, checkpoint_every=10, advantage="grpo")
    share_cpus(tree, trainer_procs)
    return ServiceConfig.model_validate(tree)


@dataclass
class Progress:
    """What the agents observed, for the progress line and the summary."""

    episodes: int = 0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=128))
    rejected_starts: int = 0
    started_at: float = field(default_factory=time.monotonic)

    def rate(self) -> float:
        """Episodes per second since the workload started."""
        return self.episodes / max(time.monotonic() - self.started_at, 1e-9)


class DemoAgents:
    """The built-in agent workload: the `openai` client against the gateway."""

    def __init__(self, config: ServiceConfig) -> None:
        import openai  # the real client, as any agent would use it

        self.config = config
        self.base = f"http://{config.gateway.host}:{config.gateway.port}"
        self.admin = config.gateway.admin_key.get_secret_value()
        self.client = openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key=self.admin,
                                         max_retries=5, timeout=120)
        self.http = httpx.AsyncClient(base_url=self.base, timeout=120)
        self.progress = Progress()

    async def aclose(self) -> None:
        """Close both HTTP clients."""
        await self.client.close()
        await self.http.aclose()

    async def answer(self, prompt: DemoPrompt, api_key: str) -> float:
        """One agent turn: ask, verify the reply, return its reward."""
        reply = await self.client.with_options(api_key=api_key).chat.completions.create(
            model=self.config.gateway.model_name, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": prompt.text}])
        return digits_reward(reply.choices[0].message.content)

    async def evaluate(self, prompts: list[DemoPrompt]) -> float:
        """Mean reward with the admin key: no session, so nothing here is trained on."""
        rewards = await asyncio.gather(*(self.answer(p, self.admin) for p in prompts))
        return statistics.fmean(rewards)

    async def run_group(self, prompt: DemoPrompt, group_size: int) -> None:
        """One GRPO group: open sessions, run an episode in each, post its reward."""
        admin = {"authorization": f"Bearer {self.admin}"}
        started = await self.http.post("/rl/sessions", headers=admin, json={
            "group_size": group_size, "task_id": prompt.task_id})
        if started.status_code == 429:  # the staleness window is full: wait for training
            self.progress.rejected_starts += 1
            await asyncio.sleep(float(started.headers.get("retry-after", "1")))
            return
        started.raise_for_status()

        async def episode(session: dict[str, Any]) -> None:
            reward = await self.answer(prompt, session["api_key"])
            posted = await self.http.post(
                "/v1/rewards", headers={"authorization": f"Bearer {session['api_key']}"},
                json={"session_id": session["session_id"], "value": reward,
                      "end_session": True})
            posted.raise_for_status()
            self.progress.episodes += 1
            self.progress.recent.append(reward)

        await asyncio.gather(*(episode(s) for s in started.json()["sessions"]))

    async def work(self, prompts: list[DemoPrompt], group_size: int, stop: asyncio.Event
                   ) -> None:
        """Run groups back to back until `stop` is set."""
        for prompt in itertools.cycle(prompts):
            if stop.is_set():
                return
            await self.run_group(prompt, group_size)

    async def status(self) -> dict[str, Any]:
        """The gateway's `/admin/status`."""
        r = await self.http.get("/admin/status",
                                headers={"authorization": f"Bearer {self.admin}"})
        r.raise_for_status()
        status: dict[str, Any] = r.json()
        return status


async def _drive(config: ServiceConfig, stack: Stack, minutes: float, trainer_procs: int = 1
                 ) -> dict[str, Any]:
    agents = DemoAgents(config)
    eval_prompts = make_prompts(EVAL_EPISODES, seed=1)
    train_prompts = make_prompts(512, seed=2)
    try:
        say("measuring the untrained policy (version 0) ...")
        baseline = await agents.evaluate(eval_prompts)
        say(f"baseline reward: {baseline:.3f}  (target {TARGET_REWARD})")
        trainer = stack.start("trainer", trainer_argv(stack.run_dir / "config.yaml",
                                                      trainer_procs))
        train_started = time.monotonic()
        stop = asyncio.Event()
        group_size = config.trainer.group_size
        workers = [asyncio.create_task(agents.work(train_prompts[i::8], group_size, stop))
                   for i in range(8)]
        deadline = time.monotonic() + minutes * 60
        total = config.trainer.total_steps or 0
        version = 0
        next_report = time.monotonic() + 5
        while trainer.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # fine-grained so train_wall_s is accurate
            if time.monotonic() < next_report:
                continue
            next_report += 5
            version = (await agents.status())["live_version"]
            p = agents.progress
            recent = statistics.fmean(p.recent) if p.recent else float("nan")
            say(f"[{time.monotonic() - p.started_at:6.0f}s] version {version}/{total}  "
                f"episodes {p.episodes}  ({p.rate():.1f}/s)  recent reward {recent:.3f}")
        train_wall = time.monotonic() - train_started
        stop.set()
        for worker in workers:  # an episode cut short stays open and times out unrewarded
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        finished = trainer.proc.poll() == 0
        if trainer.proc.poll() is None:
            trainer.stop()
        final_version = await _wait_live(agents, config, total if finished else None)
        final = await agents.evaluate(eval_prompts)
        return {"baseline_reward": baseline, "final_reward": final,
                "trained_steps": final_version, "finished": finished,
                "episodes": agents.progress.episodes,
                "episodes_per_s": agents.progress.rate(),
                "rejected_session_starts": agents.progress.rejected_starts,
                "elapsed_s": time.monotonic() - agents.progress.started_at,
                "train_wall_s": train_wall,
                "trained_episodes_per_s": final_version * config.trainer.batch_groups
                * config.trainer.group_size / max(train_wall, 1e-9)}
    finally:
        await agents.aclose()


async def _wait_live(agents: DemoAgents, config: ServiceConfig, version: int | None) -> int:
    """Wait (bounded) until the gateway serves `version`; return the live version."""
    for _ in range(100):
        live = int((await agents.status())["live_version"])
        if version is None or live >= version:
            return live
        await asyncio.sleep(0.1)
    return live


def run_workload(config: ServiceConfig, *, minutes: float, trainer_procs: int = 1
                 ) -> dict[str, Any]:
    """Start engine and gateway, measure the baseline, train with agents running, measure
    the final policy; stops every child it started. Returns the summary."""
    run_dir = config.data_dir / "demo"
    say(f"starting the engine ({config.model_dir()}, the tiny model built on first use) "
        f"and the gateway at http://{config.gateway.host}:{config.gateway.port}/v1 ...")
    with local_stack(config, run_dir, trainer=False) as stack:  # stops them all on the way out
        summary = asyncio.run(_drive(config, stack, minutes, trainer_procs))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def run_demo(config: ServiceConfig, *, minutes: float = 10.0, steps: int = 40,
             trainer_procs: int = 1) -> int:
    """Run the demo; returns the exit code (0 when the target reward was reached)."""
    try:
        with exit_on_sigterm():
            summary = run_workload(demo_config(config, steps, trainer_procs),
                                   minutes=minutes, trainer_procs=trainer_procs)
    except KeyboardInterrupt:
        say("interrupted: every process this demo started was stopped")
        return 130
    logs = config.data_dir / "logs"
    ok = summary["final_reward"] >= TARGET_REWARD
    say("\n== AReaL Service demo summary ==")
    say(f"baseline reward (untrained, v0): {summary['baseline_reward']:.3f}")
    say(f"final reward (v{summary['trained_steps']}):            {summary['final_reward']:.3f}"
        f"   target >= {TARGET_REWARD}: {'met' if ok else 'NOT met'}")
    say(f"trainer steps / weight swaps:    {summary['trained_steps']}"
        f"{'' if summary['finished'] else ' (stopped at the time budget)'}")
    say(f"episodes:                        {summary['episodes']} "
        f"({summary['episodes_per_s']:.1f}/s; {summary['rejected_session_starts']} session "
        "starts waited on the staleness window)")
    say(f"wall time:                       {summary['elapsed_s']:.0f} s  (logs in {logs})")
    return 0 if ok else 1
