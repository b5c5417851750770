"""`areal-service eval`: the dataset driver without training.

Per dataset: every question once greedily (temperature 0) and `eval.n_samples` times at
`eval.temperature`; an episode is correct when its reward reaches `eval.correct_at`.
One row per dataset (the AReaL eval table): num_questions, greedy_length, sample_length
(mean output tokens per episode), greedy_acc, sample_pass@1 and pass@k for every
configured k, with the unbiased estimator pass@k = 1 - C(n-c, k) / C(n, k) averaged over
questions (n runs of a question, c of them correct). Printed, and saved as JSON and CSV.

Against `--model DIR` (or the configured model) it starts its own engine and gateway
under `<data_dir>/eval` (own store: evaluation episodes never reach a trainer), with
client sampling so the temperatures above apply, and one session per episode so output
lengths come from the recorded completions. With `--gateway URL` it uses a running
gateway with the admin key and no sessions (nothing there is trained on); output lengths
are then known only for the built-in single-turn agent; the temperatures hold there too
(a training gateway forces its temperature only on turns in a session). Several backends share the load
when `gateway.router.backends` lists them (the gateway balances requests across them).
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import typer

from areal_service.config import ServiceConfig, with_admin_key
from areal_service.datasets import DatasetConfig, load_samples
from launcher.agent_runner import AgentRunner, EpisodeResult
from launcher.driver_config import DriverConfig
from launcher.serve import ensure_model
from launcher.stack import local_stack

CANCEL_GRACE_S = 5.0
"""After Ctrl-C, how long the episodes in flight are cancelled again and again before
their clients are closed under them (and as long again before eval stops waiting)."""


def say(message: str) -> None:
    """One line for the person watching."""
    typer.echo(message)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one question with `c` correct out of `n` runs (Chen et al.,
    2021): 1 - C(n-c, k) / C(n, k), exact in integers."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def table_row(
    name: str,
    greedy: Sequence[tuple[bool, int | None]],
    sampled: Sequence[Sequence[tuple[bool, int | None]]],
    ks: Sequence[int],
) -> dict[str, Any]:
    """The table row from per-question outcomes: `greedy[q]` = (correct, tokens) of the
    greedy run, `sampled[q]` = those of its n sampled runs."""

    def mean_len(runs: list[tuple[bool, int | None]]) -> float | None:
        lengths = [t for _, t in runs if t is not None]
        return statistics.fmean(lengths) if lengths else None

    n = len(sampled[0]) if sampled else 0
    correct = [sum(ok for ok, _ in runs) for runs in sampled]
    row: dict[str, Any] = {
        "dataset": name,
        "num_questions": len(sampled),
        "greedy_length": mean_len(list(greedy)),
        "sample_length": mean_len([r for runs in sampled for r in runs]),
        "greedy_acc": statistics.fmean(ok for ok, _ in greedy) if greedy else None,
        "sample_pass@1": statistics.fmean(c / n for c in correct) if n else None,
    }
    for k in ks:
        row[f"pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for c in correct) if n else None
    return row


class Evaluator:
    """Runs the episodes of one evaluation against a gateway."""

    def __init__(
        self,
        driver: DriverConfig,
        gateway_url: str,
        admin_key: str,
        model: str,
        *,
        use_sessions: bool,
    ) -> None:
        self.driver = driver
        self.cfg = driver.eval
        self.admin = {"authorization": f"Bearer {admin_key}"}
        self.admin_key = admin_key
        self.use_sessions = use_sessions
        self.http = httpx.AsyncClient(base_url=gateway_url, timeout=600)
        self.runner = AgentRunner(
            f"{gateway_url}/v1", agent=driver.agent, reward=driver.reward, model=model
        )
        self.slots = asyncio.Semaphore(self.cfg.concurrency)
        self.done = 0

    async def aclose(self) -> None:
        """Close the HTTP clients."""
        await self.runner.aclose()
        await self.http.aclose()

    async def episode(self, sample: dict[str, Any], temperature: float) -> tuple[bool, int | None]:
        """One run: (correct, output tokens or None)."""
        async with self.slots:
            if not self.use_sessions:
                result = await self.runner.run(
                    sample, self.admin_key, temperature=temperature, max_tokens=self.cfg.max_tokens
                )
                self.done += 1
                return result.reward >= self.cfg.correct_at, result.completion_tokens
            r = await self.http.post(
                "/rl/sessions",
                headers=self.admin,
                json={
                    "task_id": str(sample["id"]),
                    "metadata": {"source": "eval", "temperature": temperature},
                },
            )
            r.raise_for_status()
            session = r.json()
            result = await self.runner.run(
                sample, session["api_key"], temperature=temperature, max_tokens=self.cfg.max_tokens
            )
            tokens = await self._finish(session, result)
            self.done += 1
            return result.reward >= self.cfg.correct_at, tokens

    async def _finish(self, session: dict[str, Any], result: EpisodeResult) -> int:
        """Record the reward (ending the session) and sum the session's output tokens."""
        sid = session["session_id"]
        auth = {"authorization": f"Bearer {session['api_key']}"}
        r = await self.http.post(
            "/v1/rewards",
            headers=auth,
            json={"session_id": sid, "value": result.reward, "end_session": True},
        )
        r.raise_for_status()
        view = (await self.http.get(f"/rl/sessions/{sid}", headers=self.admin)).json()
        return sum(c["completion_tokens"] for c in view["completions"])

    async def dataset(self, config: DatasetConfig) -> dict[str, Any]:
        """The table row of one dataset."""
        samples = load_samples(config)
        temperature, n = self.cfg.temperature, self.cfg.n_samples
        total = len(samples) * (n + (1 if self.cfg.greedy else 0))
        self.done = 0
        started = time.monotonic()
        say(
            f"{config.label()}: {len(samples)} questions, greedy + {n} samples at "
            f"temperature {temperature} ({total} episodes)"
        )

        async def question(
            sample: dict[str, Any],
        ) -> tuple[tuple[bool, int | None] | None, list[tuple[bool, int | None]]]:
            greedy = self.episode(sample, 0.0) if self.cfg.greedy else None
            runs = [self.episode(sample, temperature) for _ in range(n)]
            out = await asyncio.gather(*(c for c in (greedy, *runs) if c is not None))
            return (out[0] if self.cfg.greedy else None), list(out[1:] if self.cfg.greedy else out)

        work = asyncio.gather(*(question(s) for s in samples))
        try:
            while not work.done():
                await asyncio.wait([work], timeout=self.cfg.progress_interval_s)
                if not work.done():
                    elapsed = time.monotonic() - started
                    rate = self.done / max(elapsed, 1e-9)
                    eta = f"{(total - self.done) / rate:.0f} s" if rate > 0 else "?"
                    say(f"  {self.done}/{total} episodes ({rate:.1f}/s, ETA {eta})")
        except asyncio.CancelledError:
            # Ctrl-C: stop the episodes in flight before the clients close under them, and
            # collect their outcome, so no "exception was never retrieved" is printed.
            # Cancelled again each second until they end: under load one Ctrl-C once
            # left eval waiting here 60 s, as if a cancellation was swallowed below us
            # (suspected: an HTTP client turning it into a connection error that it
            # retries, and a retry to a silent gateway waits its whole timeout).
            deadline = time.monotonic() + CANCEL_GRACE_S
            while not work.done() and time.monotonic() < deadline:
                work.cancel()
                await asyncio.wait([work], timeout=1.0)
            if not work.done():
                # Still not ended: close the clients under the episodes (their requests
                # then fail) and stop waiting for them soon after, rather than for ever.
                say(
                    f"episodes still running {CANCEL_GRACE_S:.0f} s after Ctrl-C: closing their clients"
                )
                await self.aclose()
                work.cancel()
                await asyncio.wait([work], timeout=CANCEL_GRACE_S)
            if work.done():
                await asyncio.gather(work, return_exceptions=True)
            else:  # its outcome is not ours to print ("exception was never retrieved")
                work.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        results = work.result()
        greedy = [g for g, _ in results if g is not None]
        return table_row(config.label(), greedy, [runs for _, runs in results], self.cfg.k)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Rows as an aligned text table (missing values as '-')."""
    if not rows:
        return "(no datasets)"
    columns = list(rows[0])

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4f}" if value <= 1.0 else f"{value:.1f}"
        return str(value)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def save_results(rows: Sequence[dict[str, Any]], out_dir: Path) -> tuple[Path, Path]:
    """results.json and results.csv under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / "results.json", out_dir / "results.csv"
    json_path.write_text(json.dumps(list(rows), indent=2))
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)
    return json_path, csv_path


async def _evaluate(
    evaluator: Evaluator, datasets: list[DatasetConfig], rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Append each dataset's row to `rows` as it completes (what an interrupted run keeps)."""
    try:
        for d in datasets:
            rows.append(await evaluator.dataset(d))
        return rows
    finally:
        await evaluator.aclose()


def eval_config(config: ServiceConfig, model: Path | None) -> ServiceConfig:
    """The config of an evaluation's own engine and gateway: `model` served, a store
    under `<data_dir>/eval`, client sampling, no staleness gate. It serves a gateway:
    the data dir's admin key is created here when needed."""
    config = with_admin_key(config)
    tree = config.model_dump(mode="python")
    tree["gateway"]["auth"]["admin_key"] = config.gateway.auth.admin_key.get_secret_value()
    tree["gateway"]["sampling"]["mode"] = "client"
    tree["gateway"]["sessions"]["staleness_gate"] = False
    if model is not None:
        tree["engine"]["model"] = str(model)
    elif tree["engine"]["model"] is None:
        tree["engine"]["model"] = str(config.model_dir())  # the tiny model, built if needed
    tree["data_dir"] = config.data_dir / "eval"
    if config.store.url is None:
        tree["store"]["url"] = f"sqlite:///{(config.data_dir / 'eval' / 'areal.db').resolve()}"
    return ServiceConfig.model_validate(tree)


def run_eval(
    driver: DriverConfig,
    config: ServiceConfig,
    *,
    model: Path | None = None,
    gateway: str | None = None,
    api_key: str | None = None,
    out_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """Evaluate every dataset; prints the table and saves it. Returns the rows."""
    datasets = driver.eval_datasets()
    out = out_dir or driver.eval.out_dir or config.data_dir / "eval"
    rows: list[dict[str, Any]] = []
    try:
        _run(driver, config, datasets, rows, model=model, gateway=gateway, api_key=api_key)
    except KeyboardInterrupt:
        done = f"{len(rows)} of {len(datasets)} dataset(s) finished"
        if rows:
            json_path, _ = save_results(rows, out)
            say(
                f"\ninterrupted ({done}); every process was stopped; the finished rows "
                f"are saved in {json_path.parent}"
            )
            say(format_table(rows))
        else:
            say(f"\ninterrupted ({done}); every process was stopped; nothing saved")
        raise
    say("")
    say(format_table(rows))
    json_path, csv_path = save_results(rows, out)
    say(f"\nsaved {json_path} and {csv_path}")
    return rows


def _run(
    driver: DriverConfig,
    config: ServiceConfig,
    datasets: list[DatasetConfig],
    rows: list[dict[str, Any]],
    *,
    model: Path | None,
    gateway: str | None,
    api_key: str | None,
) -> None:
    """Evaluate into `rows`, through `gateway` or an engine and gateway started here."""
    name = driver.model or config.gateway.model_name
    if gateway is not None:
        key = api_key or config.gateway.auth.admin_key.get_secret_value()
        evaluator = Evaluator(driver, gateway.rstrip("/"), key, name, use_sessions=False)
        asyncio.run(_evaluate(evaluator, datasets, rows))
    else:
        if model is not None and config.gateway.router.backends:
            raise ValueError(
                "--model serves a checkpoint on a local engine, but the config "
                "lists gateway.router.backends: evaluate through them without --model"
            )
        if model is None:
            ensure_model(config)  # the tiny model, only when no checkpoint is configured
        cfg = eval_config(config, model)
        with local_stack(cfg, cfg.data_dir / "run", trainer=False) as stack:
            say(f"evaluating {cfg.engine.model} behind {stack.gateway_url}/v1")
            evaluator = Evaluator(
                driver,
                stack.gateway_url,
                cfg.gateway.auth.admin_key.get_secret_value(),
                name,
                use_sessions=True,
            )
            asyncio.run(_evaluate(evaluator, datasets, rows))
