"""`areal-service demo`: the whole loop on one machine, on the embedded default.

Starts the engine (the local one, vLLM with `--engine vllm`, SGLang with `--engine sglang`: on
GPUs, or on the CPU where none is visible), the gateway and the
trainer as child processes (each with the resolved config saved under
`<data_dir>/demo/`), measures the untrained policy on the task (`demo_task.py`), then
runs agents that talk to the gateway through the `openai` client, one session per
episode, GRPO groups, rewards posted over REST, while the trainer learns from them and
hot-swaps weights into the engine. Ends with an evaluation table, before and after
training on the same prompts with the same sampling, and a summary: steps, swaps,
episodes, throughput. Ctrl-C stops every child it started, in reverse order.

Two set-ups: the project's tiny random model on the `digits` task (the default: about a
minute), or a real pretrained model from a package registry (`--model
smollm2-135m-instruct`) on held-out single-digit addition (tens of minutes on a CPU),
in a data directory of its own (`<data_dir>/demo-<model>`), so the two never share a
store or weights.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx
import typer

from areal_service.config import ServiceConfig, with_admin_key
from areal_service.serving_plan import ServingPlan
from launcher.demo_task import DemoPrompt, DemoTask, EvalSet, addition_task, digits_task
from launcher.earlier_run import fresh_start, previous_run
from launcher.launch import trainer_argv
from launcher.processes import exit_on_sigterm
from launcher.serve import with_registry_model
from launcher.stack import Stack, check_stack_ports_free, local_stack, share_cpus

STOP_AT_REWARD = 0.98
LORA_LR_SCALE = 10.0
"""With a LoRA default policy (`default_policy.lora`), the task's learning rate is multiplied by this: LoRA's best
learning rate is about 10x full fine-tuning's (Thinking Machines, "LoRA Without
Regret", 2025), since the B·A update starts at zero and is scaled by alpha / rank."""
"""Training stops early once the last 128 episodes' mean reward reaches this."""
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
REGISTRY_TASKS = {"smollm2-135m-instruct": addition_task}
"""The task each registry model's demo trains on."""


def say(message: str) -> None:
    """One progress line for the person watching."""
    typer.echo(message)


def demo_config(
    config: ServiceConfig,
    steps: int,
    trainer_procs: int = 1,
    task: DemoTask | None = None,
    *,
    eta_given: bool = True,
) -> ServiceConfig:
    """The demo's settings on top of the user's: the task's learning rate and GRPO group
    size (with a LoRA default policy, the rate times LORA_LR_SCALE), the staleness gate on,
    training sampling (temperature 1). `trainer_procs` > 1 splits the trainer's share of
    the cores between its processes. η (`trainer.max_staleness`) is the user's when
    `eta_given`; otherwise 0 where engine and trainer share the cores (`cpu_share`) and
    the config's default elsewhere. The demo serves a gateway: the data dir's admin key
    is created here when needed."""
    task = task or digits_task()
    config = with_admin_key(config)
    tree = config.model_dump(mode="python")
    tree["gateway"]["auth"]["admin_key"] = config.gateway.auth.admin_key.get_secret_value()
    tree["gateway"]["sessions"].update(staleness_gate=True, admit_wait_s=30.0)
    tree["gateway"]["sampling"]["mode"] = "training"
    settings = dict(task.trainer)
    if ServingPlan(config).default.lora is not None and "lr" in settings:
        settings["lr"] = settings["lr"] * LORA_LR_SCALE
    tree["trainer"].update(total_steps=steps, checkpoint_every=10, advantage="grpo", **settings)
    share_cpus(tree, trainer_procs)
    if tree["cpu_share"] and not eta_given:
        # One set of cores runs both sides in turn, so generating while training buys no
        # compute; staleness only costs learning per step. Measured on 2 cores
        # (docs/benchmarks/time-to-accuracy.md): 10.4 s a version at η = 0 and 10.6 s
        # at η = 2, and fewer versions to each accuracy at η = 0 (one seed each).
        tree["trainer"]["max_staleness"] = 0
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

    def __init__(self, config: ServiceConfig, task: DemoTask) -> None:
        import openai  # the real client, as any agent would use it

        self.config = config
        self.task = task
        self.base = f"http://{config.gateway.host}:{config.gateway.port}"
        self.admin = config.gateway.auth.admin_key.get_secret_value()
        self.client = openai.AsyncOpenAI(
            base_url=f"{self.base}/v1", api_key=self.admin, max_retries=5, timeout=120
        )
        self.http = httpx.AsyncClient(base_url=self.base, timeout=120)
        self.progress = Progress()

    async def aclose(self) -> None:
        """Close both HTTP clients."""
        await self.client.close()
        await self.http.aclose()

    async def answer(
        self, prompt: DemoPrompt, api_key: str, temperature: float | None = None
    ) -> float:
        """One agent turn: ask, verify the reply, return its reward. `temperature` None:
        the client sends none (a session's turn samples at the training temperature)."""
        extra = {} if temperature is None else {"temperature": temperature}
        reply = await self.client.with_options(api_key=api_key).chat.completions.create(
            model=self.config.gateway.model_name,
            max_tokens=self.task.max_tokens,
            messages=[{"role": "user", "content": prompt.text}],
            **extra,
        )
        return self.task.reward(prompt, reply.choices[0].message.content)

    async def evaluate(self, evals: list[EvalSet]) -> dict[str, dict[str, float]]:
        """Per eval set: its headline score (mean reward at its temperature: accuracy
        when greedy) and, where asked, pass@1 (mean over `sampled` samples per prompt at temperature 1). With the admin
        key: no session, so nothing here is trained on."""
        out: dict[str, dict[str, float]] = {}
        for es in evals:
            scores = await asyncio.gather(
                *(self.answer(p, self.admin, es.temperature) for p in es.prompts)
            )
            out[es.name] = {es.metric: statistics.fmean(scores)}
            if es.sampled:
                sampled = await asyncio.gather(
                    *(
                        self.answer(p, self.admin, 1.0)
                        for p in es.prompts
                        for _ in range(es.sampled)
                    )
                )
                out[es.name]["pass@1"] = statistics.fmean(sampled)
        return out

    async def run_group(self, prompt: DemoPrompt, group_size: int) -> None:
        """One GRPO group: open sessions, run an episode in each, post its reward."""
        admin = {"authorization": f"Bearer {self.admin}"}
        started = await self.http.post(
            "/rl/sessions",
            headers=admin,
            json={"group_size": group_size, "task_id": prompt.task_id},
        )
        if started.status_code == 429:  # the staleness window is full: wait for training
            self.progress.rejected_starts += 1
            await asyncio.sleep(float(started.headers.get("retry-after", "1")))
            return
        started.raise_for_status()

        async def episode(session: dict[str, Any]) -> None:
            reward = await self.answer(prompt, session["api_key"])
            posted = await self.http.post(
                "/v1/rewards",
                headers={"authorization": f"Bearer {session['api_key']}"},
                json={"session_id": session["session_id"], "value": reward, "end_session": True},
            )
            posted.raise_for_status()
            self.progress.episodes += 1
            self.progress.recent.append(reward)

        await asyncio.gather(*(episode(s) for s in started.json()["sessions"]))

    async def work(self, prompts: list[DemoPrompt], group_size: int, stop: asyncio.Event) -> None:
        """Run groups back to back until `stop` is set."""
        for prompt in itertools.cycle(prompts):
            if stop.is_set():
                return
            await self.run_group(prompt, group_size)

    async def status(self) -> dict[str, Any]:
        """The gateway's `/admin/status`."""
        r = await self.http.get("/admin/status", headers={"authorization": f"Bearer {self.admin}"})
        r.raise_for_status()
        status: dict[str, Any] = r.json()
        return status


async def _drive(
    config: ServiceConfig,
    stack: Stack,
    minutes: float,
    task: DemoTask,
    trainer_procs: int = 1,
    baseline: bool = True,
) -> dict[str, Any]:
    agents = DemoAgents(config, task)
    train_prompts = task.train
    workers: list[asyncio.Task[None]] = []
    try:
        # The trainer loads its model while the untrained policy is measured: it has
        # nothing to train on before the agents start, so the baseline stays version 0.
        trainer = stack.start("trainer", trainer_argv(stack.run_dir / "config.yaml", trainer_procs))
        before = None
        if baseline:
            say("measuring the untrained policy (version 0) ...")
            before = await agents.evaluate(task.evals)
            say(_headline("baseline", before, task))
        else:
            say("training starts at once (--no-baseline: the untrained policy is not measured)")
        train_started = time.monotonic()
        stop = asyncio.Event()
        group_size = config.trainer.group_size
        workers += [
            asyncio.create_task(agents.work(train_prompts[i::8], group_size, stop))
            for i in range(8)
        ]
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
            say(
                f"[{time.monotonic() - p.started_at:6.0f}s] version {version}/{total}  "
                f"episodes {p.episodes}  ({p.rate():.1f}/s)  recent reward {recent:.3f}"
            )
            if len(p.recent) == p.recent.maxlen and recent >= STOP_AT_REWARD and version:
                say(
                    f"recent reward {recent:.3f} >= {STOP_AT_REWARD}: stopping the trainer "
                    "after its current step"
                )
                break
        train_wall = time.monotonic() - train_started
        stop.set()
        for worker in workers:  # an episode cut short stays open and times out unrewarded
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        finished = trainer.proc.poll() == 0
        if trainer.proc.poll() is None:
            trainer.stop()  # SIGTERM: it finishes its step and publishes it
        published = await asyncio.to_thread(_published_version, config)
        final_version = await _wait_live(agents, config, total if finished else published)
        final = await agents.evaluate(task.evals)
        return {
            "task": task.name,
            "baseline": before,
            "final": final,
            "trained_steps": final_version,
            "finished": finished,
            "episodes": agents.progress.episodes,
            "episodes_per_s": agents.progress.rate(),
            "rejected_session_starts": agents.progress.rejected_starts,
            "elapsed_s": time.monotonic() - agents.progress.started_at,
            "train_wall_s": train_wall,
            "trained_episodes_per_s": final_version
            * config.trainer.batch_groups
            * config.trainer.group_size
            / max(train_wall, 1e-9),
        }
    finally:
        # Ctrl-C cancels this task only: the agents' tasks are stopped and collected here,
        # before their clients close and the gateway stops under them (else each one's
        # error would print as "Task exception was never retrieved").
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await agents.aclose()


def _published_version(config: ServiceConfig) -> int | None:
    """The newest version the trainer recorded in the store (what the gateway swaps to),
    None before any."""
    from areal_service.store import TrajectoryStore

    store = TrajectoryStore.open(config.database_url(), config.store)
    try:
        latest = store.latest_weight_version()
    finally:
        store.close()
    return None if latest is None else latest.version


def headline(scores: dict[str, dict[str, float]], task: DemoTask) -> float:
    """The task's headline score: the first eval set's main metric."""
    first = task.evals[0]
    return scores[first.name][first.metric]


def _headline(label: str, scores: dict[str, dict[str, float]], task: DemoTask) -> str:
    first = task.evals[0]
    return (
        f"{label}: {first.name}, {first.metric} {headline(scores, task):.3f}  "
        f"(target {task.target})"
    )


async def _wait_live(agents: DemoAgents, config: ServiceConfig, version: int | None) -> int:
    """Wait (bounded, 60 s: a large model's swap takes seconds) until the gateway serves
    `version`; return the live version."""
    for _ in range(600):
        live = int((await agents.status())["live_version"])
        if version is None or live >= version:
            return live
        await asyncio.sleep(0.1)
    return live


def run_workload(
    config: ServiceConfig,
    *,
    minutes: float,
    trainer_procs: int = 1,
    task: DemoTask | None = None,
    baseline: bool = True,
) -> dict[str, Any]:
    """Start engine and gateway, measure the baseline (unless `baseline` is False: the
    summary's is None), train with agents running, measure the final policy; stops every
    child it started. Returns the summary."""
    task = task or digits_task()
    run_dir = config.data_dir / "demo"
    engine = ENGINE_NAMES.get(config.engine.backend, "the local engine")
    say(
        f"starting {engine} ({config.model_dir()}) and the gateway at "
        f"http://{config.gateway.host}:{config.gateway.port}/v1 ..."
    )
    with local_stack(config, run_dir, trainer=False) as stack:  # stops them all on the way out
        summary = asyncio.run(_drive(config, stack, minutes, task, trainer_procs, baseline))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def model_config(config: ServiceConfig, model: str | None, engine: str | None) -> ServiceConfig:
    """`config` for `--model NAME` (a registry model, built on first use into
    `<data_dir>/models/NAME`, served from a data dir of its own) and `--engine`."""
    if model is not None:
        from engine.pretrained import registry_model

        registry_model(model)  # ValueError naming the known models
        # The ports before the model: building it takes most of a minute the first time.
        check_stack_ports_free(config)
        config = with_registry_model(config, model)
        config = config.model_copy(update={"data_dir": config.data_dir / f"demo-{model}"})
    if engine is not None:
        config = config.model_copy(
            update={"engine": config.engine.model_copy(update={"backend": engine})}
        )
    config = ServiceConfig.model_validate(config.model_dump())  # the cross-field checks
    if config.engine.backend == "vllm":
        from launcher.vllm_servers import check_vllm_python

        check_vllm_python(config)
    if config.engine.backend == "sglang":
        from launcher.sglang_servers import check_sglang_python, sglang_specs

        check_sglang_python(config)
        sglang_specs(config)  # ValueError: what SGLang cannot run here, in one line
    return config


def print_table(summary: dict[str, Any], task: DemoTask) -> None:
    """The before/after evaluation table and the headline line."""
    version = summary["trained_steps"]
    baseline = summary["baseline"]  # None: not measured (--no-baseline)
    say(f"\n{'evaluation':<44} {'before (v0)':>12} {f'after (v{version})':>12}")
    for es in task.evals:
        after = summary["final"][es.name]
        rows = [(f"{es.name}, {es.metric}", es.metric)]
        if "pass@1" in after:
            rows.append((f"{es.name}, pass@1 (T=1, {es.sampled}/q)", "pass@1"))
        for label, key in rows:
            before = "not measured" if baseline is None else f"{baseline[es.name][key]:.3f}"
            say(f"{label:<44} {before:>12} {after[key]:>12.3f}")
    first = task.evals[0]
    kind = "accuracy (greedy)" if first.temperature == 0 else first.metric
    before = "not measured" if baseline is None else f"{headline(baseline, task):.3f}"
    say(f"\nheld-out {kind}: before {before} after {headline(summary['final'], task):.3f}")


def run_demo(
    config: ServiceConfig,
    *,
    minutes: float | None = None,
    steps: int | None = None,
    trainer_procs: int = 1,
    model: str | None = None,
    engine: str | None = None,
    fresh: bool = False,
    baseline: bool = True,
) -> int:
    """Run the demo; returns the exit code (0 when the headline target was reached).
    Defaults: 10 minutes / 40 steps on the tiny model, 30 minutes / 80 steps on a
    registry model. `baseline` False: training starts without the untrained policy's
    evaluation (the table's "before" column says not measured)."""
    task = REGISTRY_TASKS[model]() if model in REGISTRY_TASKS else digits_task()
    if model is not None and model not in REGISTRY_TASKS:
        raise ValueError(f"no demo task for {model!r}; known: {', '.join(REGISTRY_TASKS)}")
    real = model is not None
    eta_given = "max_staleness" in config.trainer.model_fields_set  # before model_config
    minutes = minutes if minutes is not None else (30.0 if real else 10.0)
    steps = steps if steps is not None else (80 if real else 40)
    config = model_config(config, model, engine)
    if fresh:
        for path in fresh_start(config):
            say(f"--fresh: deleted {path}")
    else:
        left = previous_run(config)
        if left is not None:
            raise ValueError(
                f"{config.data_dir} holds an earlier run ({left}): the demo would resume it, "
                "train nothing and measure the trained model as its baseline. Start over "
                "with `areal-service demo --fresh` (deletes that run, keeps the model and "
                "the admin key), or use another folder: --set data_dir=..."
            )
    try:
        with exit_on_sigterm():
            summary = run_workload(
                demo_config(config, steps, trainer_procs, task, eta_given=eta_given),
                minutes=minutes,
                trainer_procs=trainer_procs,
                task=task,
                baseline=baseline,
            )
    except KeyboardInterrupt:
        say("interrupted: every process this demo started was stopped")
        return 130
    except SystemExit as stop:  # SIGTERM (`exit_on_sigterm`)
        if stop.code != 128 + signal.SIGTERM:
            raise
        say("stopped by SIGTERM: every process this demo started was stopped")
        return 128 + signal.SIGTERM
    logs = config.data_dir / "logs"
    ok = headline(summary["final"], task) >= task.target
    say(f"\n== AReaL Service demo summary ({config.model_dir().name}, task {task.name}) ==")
    print_table(summary, task)
    say(f"target >= {task.target}: {'met' if ok else 'NOT met'}")
    say(
        f"trainer steps / weight swaps:    {summary['trained_steps']}"
        f"{'' if summary['finished'] else ' (stopped early or at the time budget)'}"
    )
    say(
        f"episodes:                        {summary['episodes']} "
        f"({summary['episodes_per_s']:.1f}/s; {summary['rejected_session_starts']} session "
        "starts waited on the staleness window)"
    )
    say(f"wall time:                       {summary['elapsed_s']:.0f} s  (logs in {logs})")
    return 0 if ok else 1
