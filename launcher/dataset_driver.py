"""`areal-service train --config cfg.yaml`: train on a dataset.

Starts the engine, the gateway and the trainer (`launcher/stack.py`), then walks the
dataset: for each sample it opens a GRPO group of `rollout.group_size` sessions over
`POST /rl/sessions`, runs the agent once per session with that session's key, posts
each episode's reward over `POST /v1/rewards` (ending the session), and lets the trainer
learn from the finished groups while the next ones run. An episode whose agent raised is
not scored: its session ends as `failed`, the trainer drops it alone and trains its group
on the rest. Stops every child on the way
out, Ctrl-C and SIGTERM included.

Resume: `<data_dir>/driver/state.json` records the epoch, the samples whose group is
complete, and the sessions of the groups in flight, rewritten atomically after every
change. A rerun skips the finished samples; a group cut short has its open sessions
ended as `no_reward` and, because the driver runs the trainer with
`unrewarded_policy: drop_group`, is dropped whole (never trained half-scored); its
sample runs again. The trainer resumes from its own checkpoint and the store.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

import httpx
import typer
from pydantic import BaseModel, Field

from areal_service.config import ServiceConfig, with_admin_key
from areal_service.datasets import load_samples
from areal_service.types import END_FAILED
from launcher.agent_runner import AgentRunner, EpisodeResult
from launcher.driver_config import DriverConfig
from launcher.processes import ChildProcess, exit_on_sigterm
from launcher.stack import Stack, local_stack, share_cpus

log = logging.getLogger(__name__)

STATE_FILE = "state.json"


def say(message: str) -> None:
    """One line for the person watching."""
    typer.echo(message, err=False)


# ---- persisted position ---------------------------------------------------------------


class DriverState(BaseModel):
    """The driver's position in the dataset (`<data_dir>/driver/state.json`)."""

    fingerprint: dict[str, Any]
    """What the position is valid for (dataset, size, group size, order); a different
    run in the same data_dir starts over."""
    epoch: int = 0
    done: list[int] = Field(default_factory=list)
    """Sample indices of the current epoch whose group is complete (all rewarded)."""
    in_flight: dict[str, list[str]] = Field(default_factory=dict)
    """Sample index -> session ids of groups started and not yet complete."""
    episodes: int = 0
    """Episodes rewarded so far, over every run."""
    reward_sum: float = 0.0
    finished: bool = False
    """Every epoch's episodes are rewarded."""

    @classmethod
    def load(cls, path: Path, fingerprint: dict[str, Any]) -> DriverState:
        """The saved state when it matches `fingerprint`, else a fresh one."""
        if path.is_file():
            saved = cls.model_validate_json(path.read_text())
            if saved.fingerprint == fingerprint:
                return saved
            log.warning(
                "%s is for another run (%s); starting at the first sample", path, saved.fingerprint
            )
        return cls(fingerprint=fingerprint)

    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename), so a crash leaves the old or new copy."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.model_dump_json())
        os.replace(tmp, path)


def epoch_order(n: int, epoch: int, *, shuffle: bool, seed: int) -> list[int]:
    """The order samples are visited in `epoch` (deterministic, so a resume agrees)."""
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


# ---- config ---------------------------------------------------------------------------


def training_config(driver: DriverConfig, config: ServiceConfig, num_samples: int) -> ServiceConfig:
    """The service config the driver runs with: trainer batches of `batch_size` groups of
    `group_size`, as many steps as the epochs hold whole batches, unscored sessions
    dropped (see the module docstring), the staleness gate on so rollouts never run
    more than `trainer.max_staleness` versions ahead. The driver serves a gateway: the
    data dir's admin key is created here when needed."""
    roll = driver.rollout
    config = with_admin_key(config)
    tree = config.model_dump(mode="python")
    tree["gateway"]["auth"]["admin_key"] = config.gateway.auth.admin_key.get_secret_value()
    tree["gateway"]["sessions"]["staleness_gate"] = True
    trainer = tree["trainer"]
    trainer.update(
        group_size=roll.group_size,
        batch_groups=roll.batch_size,
        total_steps=roll.epochs * num_samples // roll.batch_size,
    )
    trainer["unrewarded_policy"] = "drop_group"  # a group with an unscored session is never trained
    if roll.group_size < 2 and trainer["advantage"] in ("grpo", "drgrpo", "rloo"):
        trainer["advantage"] = "batch"  # a group of one has no group baseline
    share_cpus(tree)
    return ServiceConfig.model_validate(tree)


# ---- progress -------------------------------------------------------------------------


class ProgressLine:
    """Plain progress lines: epoch, step, samples, episodes, reward, rate, ETA."""

    def __init__(self, total_episodes: int, total_steps: int, epochs: int) -> None:
        self.total_episodes = total_episodes
        self.total_steps = total_steps
        self.epochs = epochs
        self.started = time.monotonic()
        self.new_episodes = 0
        self.recent: deque[float] = deque(maxlen=256)

    def add(self, result: EpisodeResult) -> None:
        """Count one rewarded episode."""
        self.new_episodes += 1
        self.recent.append(result.reward)

    def line(self, *, epoch: int, step: int, done_episodes: int, errors: int) -> str:
        """The current line."""
        elapsed = time.monotonic() - self.started
        rate = self.new_episodes / elapsed if elapsed > 0 else 0.0
        left = max(self.total_episodes - done_episodes, 0)
        eta = _duration(left / rate) if rate > 0 else "?"
        reward = f"{statistics.fmean(self.recent):.3f}" if self.recent else "-"
        pct = 100.0 * done_episodes / max(self.total_episodes, 1)
        failed = f" | {errors} agent errors" if errors else ""
        return (
            f"epoch {epoch + 1}/{self.epochs} | step {step}/{self.total_steps} | "
            f"episodes {done_episodes}/{self.total_episodes} ({pct:.0f}%) | "
            f"reward {reward} | {rate:.2f} ep/s | ETA {eta}{failed}"
        )


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# ---- the driver -----------------------------------------------------------------------


class DatasetDriver:
    """Walks the dataset against a running gateway (and trainer) and keeps the state."""

    def __init__(
        self,
        driver: DriverConfig,
        config: ServiceConfig,
        samples: list[dict[str, Any]],
        stack: Stack,
        state: DriverState,
        state_path: Path,
    ) -> None:
        self.driver = driver
        self.config = config
        self.samples = samples
        self.stack = stack
        self.state = state
        self.state_path = state_path
        admin = config.gateway.auth.admin_key.get_secret_value()
        self.admin = {"authorization": f"Bearer {admin}"}
        self.http = httpx.AsyncClient(base_url=stack.gateway_url, timeout=600)
        self.runner = AgentRunner(
            f"{stack.gateway_url}/v1",
            agent=driver.agent,
            reward=driver.reward,
            model=driver.model or config.gateway.model_name,
        )
        roll = driver.rollout
        self.total_episodes = roll.epochs * len(samples) * roll.group_size
        self.progress = ProgressLine(
            self.total_episodes, config.trainer.total_steps or 0, roll.epochs
        )
        self.errors = 0
        self.step = 0

    async def aclose(self) -> None:
        """Close the HTTP clients."""
        await self.runner.aclose()
        await self.http.aclose()

    def _save(self) -> None:
        self.state.save(self.state_path)

    # -- recovery --

    async def recover(self) -> None:
        """Settle the groups a previous run left in flight: complete ones count as done,
        the rest have their open sessions ended unscored (dropped by the trainer) and
        their samples run again."""
        for index, session_ids in sorted(self.state.in_flight.items()):
            views = []
            for sid in session_ids:
                r = await self.http.get(f"/rl/sessions/{sid}", headers=self.admin)
                views.append(r.json() if r.status_code == 200 else None)
            complete = all(
                v is not None
                and v["status"] != "open"
                and (v["rewards"] or v["end_reason"] == END_FAILED)
                for v in views
            )
            if complete:
                self.state.done.append(int(index))
                self.state.episodes += len(views)
                self.state.reward_sum += sum(rw["value"] for v in views for rw in v["rewards"])
            else:
                for v in views:
                    if v is not None and v["status"] == "open":
                        await self.http.post(
                            f"/rl/sessions/{v['session_id']}/end",
                            headers=self.admin,
                            json={"no_reward": True},
                        )
                log.info("sample %s: its interrupted group is dropped; it runs again", index)
        if self.state.in_flight:
            say(
                f"resuming: {len(self.state.in_flight)} group(s) in flight when the last run "
                "stopped were settled"
            )
        self.state.in_flight = {}
        self._save()

    # -- one group --

    async def open_group(self, index: int, epoch: int) -> list[dict[str, Any]]:
        """Open the sample's group; waits while the staleness gate says 429."""
        sample = self.samples[index]
        body = {
            "group_size": self.driver.rollout.group_size,
            "task_id": str(sample["id"]),
            "metadata": {"source": "dataset-driver", "sample_index": index, "epoch": epoch},
        }
        while True:
            r = await self.http.post("/rl/sessions", headers=self.admin, json=body)
            if r.status_code != 429:
                break
            self._check_trainer()  # the window only opens as the trainer steps
            await asyncio.sleep(float(r.headers.get("retry-after", "1")))
        r.raise_for_status()
        sessions: list[dict[str, Any]] = r.json()["sessions"]
        return sessions

    async def run_episode(self, sample: dict[str, Any], session: dict[str, Any]) -> EpisodeResult:
        """The agent in one session, then its reward(s) posted with the session's key (or,
        if the agent raised, the session ended as failed)."""
        key = session["api_key"]
        result = await self.runner.run(sample, key, max_tokens=self.driver.rollout.max_tokens)
        auth = {"authorization": f"Bearer {key}"}
        sid = session["session_id"]
        if result.error:
            # Not the policy's score: the trainer drops this session alone (end reason
            # `failed`) and its group trains on the rest (the runner logged the error).
            r = await self.http.post(f"/rl/sessions/{sid}/end", headers=auth, json={"failed": True})
            r.raise_for_status()
            return result
        if result.completion_rewards:
            for cid, value in result.completion_rewards.items():
                r = await self._reward(auth, f"rwd_{sid}_{cid}", completion_id=cid, value=value)
                r.raise_for_status()
            r = await self.http.post(f"/rl/sessions/{sid}/end", headers=auth)
        else:
            r = await self._reward(
                auth, f"rwd_{sid}", session_id=sid, value=result.reward, end_session=True
            )
        r.raise_for_status()
        return result

    async def _reward(
        self, auth: dict[str, str], reward_id: str, **target: str | float | bool
    ) -> httpx.Response:
        """`POST /v1/rewards` of one reward (`target`: what it rewards, its value, and
        whether it ends the session)."""
        body = {"id": reward_id, **target, "metadata": {}}
        return await self.http.post("/v1/rewards", headers=auth, json=body)

    async def run_group(self, index: int, epoch: int) -> None:
        """Open, run and score one sample's group; record it in the state."""
        sessions = await self.open_group(index, epoch)
        self.state.in_flight[str(index)] = [s["session_id"] for s in sessions]
        self._save()
        sample = self.samples[index]
        results = await asyncio.gather(*(self.run_episode(sample, s) for s in sessions))
        for result in results:
            self.progress.add(result)
            self.errors += result.error is not None
        self.state.in_flight.pop(str(index), None)
        self.state.done.append(index)
        self.state.episodes += len(results)
        self.state.reward_sum += sum(r.reward for r in results)
        self._save()

    # -- the walk --

    async def report(self, epoch: int, *, show: bool = True) -> None:
        """Refresh the step (the gateway's live version); print a progress line."""
        try:
            r = await self.http.get("/admin/status", headers=self.admin)
            self.step = int(r.json()["live_version"])
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        if show:
            say(
                self.progress.line(
                    epoch=epoch,
                    step=self.step,
                    done_episodes=self.state.episodes,
                    errors=self.errors,
                )
            )

    async def walk(self) -> None:
        """Every remaining group of every remaining epoch, `concurrency` episodes at once."""
        roll = self.driver.rollout
        slots = asyncio.Semaphore(max(1, -(-roll.concurrency // roll.group_size)))
        while self.state.epoch < roll.epochs:
            epoch = self.state.epoch
            done = set(self.state.done)
            todo = [
                i
                for i in epoch_order(len(self.samples), epoch, shuffle=roll.shuffle, seed=roll.seed)
                if i not in done
            ]
            running: set[asyncio.Task[None]] = set()
            next_report = time.monotonic() + roll.progress_interval_s
            for index in todo:
                await slots.acquire()
                self._check_trainer()
                task = asyncio.create_task(self.run_group(index, epoch))
                task.add_done_callback(lambda _t: slots.release())
                running.add(task)
                running = {t for t in running if not _finished(t)}
                if time.monotonic() >= next_report:
                    next_report = time.monotonic() + roll.progress_interval_s
                    await self.report(epoch)
            while running:
                finished, running = await asyncio.wait(running, timeout=roll.progress_interval_s)
                for task in finished:
                    _finished(task)
                await self.report(epoch)
            self.state.epoch += 1
            self.state.done = []
            self._save()
        self.state.finished = True
        self._save()
        await self.report(roll.epochs - 1)

    def _check_trainer(self) -> None:
        """Raise when the trainer died: nothing would consume the episodes (called while
        walking, before the state is finished)."""
        trainer = self._trainer()
        if trainer is not None and trainer.proc.poll() is not None:
            raise RuntimeError(
                f"the trainer exited with code {trainer.proc.returncode} (see "
                f"{self.config.data_dir / 'logs' / 'trainer.log'})"
            )

    def _trainer(self) -> ChildProcess | None:
        return next((c for c in self.stack.children if c.name == "trainer"), None)

    async def drain(self) -> bool:
        """Wait for the trainer to finish its steps; stop it when it goes
        `drain_timeout_s` without a new step. True when it reached total_steps."""
        trainer = self._trainer()
        if trainer is None:
            return True
        last_step, last_change = self.step, time.monotonic()
        interval = self.driver.rollout.progress_interval_s
        next_line = time.monotonic() + interval
        total = self.config.trainer.total_steps
        if trainer.proc.poll() is None:
            # The episode lines would sit at 100% / ETA 0 while the last steps train.
            say(f"all episodes ran; the trainer is finishing its steps ({self.step}/{total}) ...")
        drained_at = time.monotonic()
        while trainer.proc.poll() is None:
            await asyncio.sleep(min(1.0, interval))
            await self.report(self.driver.rollout.epochs - 1, show=False)
            if time.monotonic() >= next_line:
                next_line += interval
                say(
                    f"trainer: step {self.step}/{total} "
                    f"({time.monotonic() - drained_at:.0f} s after the last episode)"
                )
            if self.step != last_step:
                last_step, last_change = self.step, time.monotonic()
            elif time.monotonic() - last_change > self.driver.rollout.drain_timeout_s:
                say(
                    "the trainer made no step for "
                    f"{self.driver.rollout.drain_timeout_s:.0f} s: stopping it"
                )
                trainer.stop()
                return False
        return trainer.proc.returncode == 0


def _finished(task: asyncio.Task[None]) -> bool:
    """Whether `task` is done; raises its exception when it failed (a group's failure
    stops the walk)."""
    if not task.done():
        return False
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]
    return True


async def _drive(driver_obj: DatasetDriver) -> dict[str, Any]:
    try:
        await driver_obj.recover()
        if not driver_obj.state.finished:
            await driver_obj.walk()
        reached = await driver_obj.drain()
        state = driver_obj.state
        return {
            "episodes": state.episodes,
            "steps": driver_obj.step,
            "total_steps": driver_obj.config.trainer.total_steps,
            "mean_reward": state.reward_sum / max(state.episodes, 1),
            "agent_errors_this_run": driver_obj.errors,
            "trainer_finished": reached,
        }
    finally:
        await driver_obj.aclose()


def trained_steps(config: ServiceConfig) -> int:
    """The last step the trainer recorded in the store (0 before the first)."""
    from areal_service.store import TrajectoryStore

    config.data_dir.mkdir(parents=True, exist_ok=True)
    store = TrajectoryStore.open(config.database_url(), config.store)
    try:
        latest = store.latest_train_step()
    finally:
        store.close()
    return latest.step if latest else 0


def run_training(driver: DriverConfig, config: ServiceConfig) -> int:
    """`areal-service train`: returns the exit code (0 done, 130 Ctrl-C, 143 SIGTERM)."""
    if driver.dataset is None:
        raise ValueError("the config names no dataset (a `dataset:` section with a path)")
    samples = load_samples(driver.dataset)
    if not samples:
        raise ValueError(f"dataset {driver.dataset.path} has no rows")
    config = training_config(driver, config, len(samples))
    roll = driver.rollout
    run_dir = config.data_dir / "driver"
    state_path = run_dir / STATE_FILE
    fingerprint = {
        "dataset": str(driver.dataset.path),
        "samples": len(samples),
        "group_size": roll.group_size,
        "epochs": roll.epochs,
        "shuffle": roll.shuffle,
        "seed": roll.seed,
    }
    state = DriverState.load(state_path, fingerprint)
    say(
        f"dataset {driver.dataset.label()}: {len(samples)} samples x {roll.group_size} "
        f"episodes x {roll.epochs} epoch(s); {config.trainer.total_steps} trainer steps of "
        f"{roll.batch_size} groups"
    )
    if state.finished:
        trained = trained_steps(config)
        if trained >= (config.trainer.total_steps or 0):
            say(
                f"nothing to do: all {state.episodes} episodes ran and the trainer is at step "
                f"{trained}/{config.trainer.total_steps} (weights in {config.weights_dir()})"
            )
            return 0
        say(
            f"all {state.episodes} episodes ran; the trainer is at step {trained}/"
            f"{config.trainer.total_steps}: finishing its steps"
        )
    elif state.episodes:
        say(
            f"resuming at epoch {state.epoch + 1}: {len(state.done)} samples of this epoch "
            f"done, {state.episodes} episodes recorded before"
        )
    try:
        # SIGTERM unwinds like Ctrl-C (SystemExit 143), so the children are stopped and
        # the state is kept.
        with exit_on_sigterm(), local_stack(config, run_dir, trainer=True) as stack:
            say(f"gateway at {stack.gateway_url}/v1; logs in {config.data_dir / 'logs'}")
            driver_obj = DatasetDriver(driver, config, samples, stack, state, state_path)
            summary = asyncio.run(_drive(driver_obj))
    except (KeyboardInterrupt, SystemExit) as stop:
        code = 130 if isinstance(stop, KeyboardInterrupt) else stop.code
        if code not in (130, 128 + signal.SIGTERM):
            raise  # not an interruption
        say(
            f"interrupted: every process was stopped; position saved in {state_path} "
            "(run the same command again to resume)"
        )
        return int(code)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    say(
        f"done: {summary['episodes']} episodes, mean reward {summary['mean_reward']:.3f}, "
        f"trainer at step {summary['steps']}/{summary['total_steps']}; weights in "
        f"{config.weights_dir()}"
    )
    return 0 if summary["trainer_finished"] else 1
