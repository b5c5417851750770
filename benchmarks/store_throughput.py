"""Trajectory store throughput: durable completion writes, parent linking, claiming and
export, measured against the project's targets.

0. record CPU: thread CPU µs per record of `add_completions` (what the gateway's writer
   thread spends: Python holding the GIL, plus driver C work that releases it; py-spy
   --gil tells them apart) for batches of 1, 16 and 64
   gateway-shaped records (65-token prompt, 32 output tokens, a short chat's request
   and response JSON, one session each), best of 5 rounds.
1. writes: C asyncio writers (one session each) push N completions with 1k-token
   prompts and 1k-token outputs through `ParentLinker.link_parent` and
   `GroupCommitWriter.write`; a write returns once its transaction committed. With
   `--postgres-url` the rounds alternate between SQLite and PostgreSQL (the same load
   on the host for both) and a closing table puts the medians side by side, with
   PostgreSQL's server CPU per completion when the server runs on this host.
2. link: `link_parent` latency in a 50-turn session whose prompt grows by ~1k tokens a
   turn (warm cache), and the first call of a cold linker (one store query).
3. claim: E ended, rewarded sessions in groups of 4 (one 1k+1k completion each) are
   claimed by `EpisodeClaimer.claim_groups` (32 groups a call) and marked trained.
4. export: the same sessions streamed to Parquet (rows/s).

Run: `python -m benchmarks.store_throughput [--records 5000] [--writers 64]
[--rounds 3] [--episodes 2000] [--postgres-url postgresql+psycopg://u@host:port/postgres]
[--cpu-only | --writes-only]`.
SQLite runs in a temp directory; PostgreSQL in a temp database created and dropped here.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from sqlalchemy import insert, text

from areal_service.config import StoreConfig
from areal_service.export import export_sequences
from areal_service.store import TrajectoryStore
from areal_service.store.claims import EpisodeClaimer
from areal_service.store.connect import scratch_postgres_database
from areal_service.store.linking import ParentLinker
from areal_service.store.schema import RewardRow, SessionRow
from areal_service.store.writer import GroupCommitWriter
from areal_service.types import CompletionRecord, SessionRecord

TARGETS = {"writes": 2000.0, "claim": 500.0, "writes_postgresql": 3000.0}
"""completions/s durable on SQLite; episodes/s claimed; completions/s durable on
PostgreSQL (two gateway replicas share one server: its capacity is the limit)."""
SQLITE, POSTGRES = "sqlite (WAL, synchronous=NORMAL)", "postgresql"
TOKENS = 1000
CPU_BATCHES = (1, 16, 64)
CHAT = [
    {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
    {"role": "user", "content": "What is the capital of France, and why is it famous?"},
]


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(150_000) for _ in range(n))


def _record(
    cid: str, sid: str, prompt: tuple[int, ...], output: tuple[int, ...]
) -> CompletionRecord:
    return CompletionRecord(
        id=cid,
        model="bench",
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=tuple(-0.001 * (i % 50) for i in range(len(output))),
        output_versions=(3,) * len(output),
        finish_reason="stop",
        session_id=sid,
        request_json={"messages": [{"role": "user", "content": "x" * 200}]},
        response_json={"choices": [{"message": {"role": "assistant", "content": "y" * 400}}]},
    )


def _gateway_record(rng: random.Random, sid: str) -> CompletionRecord:
    """A record as the gateway captures a short non-streamed chat (max_tokens 32)."""
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    usage = {
        "prompt_tokens": 65,
        "completion_tokens": 32,
        "total_tokens": 97,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    message = {"role": "assistant", "content": "Paris is the capital of France. " * 5}
    return CompletionRecord(
        id=cid,
        model="areal-policy",
        prompt_ids=_tokens(rng, 65),
        output_ids=_tokens(rng, 32),
        output_logprobs=tuple(-rng.random() for _ in range(32)),
        output_versions=(0,) * 32,
        finish_reason="length",
        session_id=sid,
        api_key_id="key-bench",
        request_json={"model": "areal-policy", "messages": CHAT, "max_tokens": 32},
        response_json={
            "id": cid,
            "object": "chat.completion",
            "created": 1_700_000_000,
            "model": "areal-policy",
            "usage": usage,
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
            ],
        },
        backend="http://127.0.0.1:30000",
        latency_ms=12.5,
        prompt_tokens=65,
        completion_tokens=32,
    )


def bench_record_cpu(store: TrajectoryStore) -> dict[int, float]:
    """Batch size -> thread CPU µs per record of `add_completions`: best of 5 rounds
    (128 single-record batches, else 512 records) after a warm-up round."""
    rng = random.Random(3)
    sessions = [f"cpu-{uuid.uuid4().hex[:8]}-{i}" for i in range(64)]
    for sid in sessions:
        store.add_session(SessionRecord(id=sid))
    result: dict[int, float] = {}
    for size in CPU_BATCHES:
        rounds = [
            [
                [_gateway_record(rng, sessions[(b * size + k) % 64]) for k in range(size)]
                for b in range(max(512 // size // (4 if size == 1 else 1), 8))
            ]
            for _ in range(6)
        ]
        for batch in rounds[0]:  # warm-up
            store.add_completions(batch)
        best = float("inf")
        for batches in rounds[1:]:
            start = time.thread_time()
            for batch in batches:
                store.add_completions(batch)
            best = min(best, (time.thread_time() - start) / (len(batches) * size))
        result[size] = best * 1e6
    return result


async def bench_writes(
    store: TrajectoryStore,
    records: int,
    writers: int,
    server_cpu: Callable[[], dict[int, float] | None] = lambda: None,
) -> tuple[float, float, float | None]:
    """(completions/s, CPU µs per completion in all threads of this process, the
    database server's CPU µs per completion or None), each write acknowledged only
    after its commit."""
    rng = random.Random(0)
    sessions = [f"w-{uuid.uuid4().hex[:8]}-{i}" for i in range(writers)]
    for sid in sessions:
        store.add_session(SessionRecord(id=sid))
    # Arrays are shared between records (building tuples is the gateway's cost, not the
    # store's); every record is still packed, hashed and written in full.
    prompts = [_tokens(rng, TOKENS) for _ in range(8)]
    outputs = [_tokens(rng, TOKENS) for _ in range(8)]
    writer = GroupCommitWriter.from_config(store, StoreConfig())
    linker = ParentLinker(store)
    writer.start()

    async def one_writer(index: int) -> None:
        sid = sessions[index]
        for turn in range(index, records, writers):
            record = _record(f"{sid}-{turn}", sid, prompts[turn % 8], outputs[turn % 8])
            await writer.write(linker.link_parent(record))

    server_before = server_cpu()
    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one_writer(i) for i in range(writers)))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    server_after = server_cpu()
    writer.stop()
    assert writer.records == records and writer.failed == 0
    server_us = None
    if server_before is not None and server_after is not None:
        used = sum(t - server_before.get(pid, 0.0) for pid, t in server_after.items())
        server_us = used / records * 1e6
    return records / elapsed, cpu / records * 1e6, server_us


def postgres_cpu(store: TrajectoryStore) -> Callable[[], dict[int, float] | None]:
    """A probe for the CPU seconds used so far by each PostgreSQL process serving
    `store`'s database (its backends, the WAL writer, checkpointer and background
    writer), read from /proc; None when the server is not a process on this host (a
    remote or containerised server: its pids are not ours to read)."""
    query = text(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " OR backend_type IN ('walwriter', 'checkpointer', 'background writer')"
    )
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def probe() -> dict[int, float] | None:
        with store.engine.connect() as connection:
            pids = list(connection.execute(query).scalars())
        seconds: dict[int, float] = {}
        for pid in pids:
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() != "postgres":
                    return None
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                return None
            seconds[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        return seconds

    return probe if probe() is not None else lambda: None


def bench_write_rounds(
    stores: dict[str, TrajectoryStore], args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """Dialect -> median of `args.rounds` write rounds (`writes`, `writes_cpu_us`,
    `writes_server_us` when known); the rounds alternate between dialects."""
    probes = {
        name: postgres_cpu(store) if name == POSTGRES else (lambda: None)
        for name, store in stores.items()
    }
    rounds: dict[str, list[tuple[float, float, float | None]]] = {name: [] for name in stores}
    for _ in range(args.rounds):
        for name, store in stores.items():
            rounds[name].append(
                asyncio.run(bench_writes(store, args.records, args.writers, probes[name]))
            )
    results: dict[str, dict[str, float]] = {}
    for name, measured in rounds.items():
        rates, cpus, servers = zip(*measured, strict=True)
        results[name] = {
            "writes": statistics.median(rates),
            "writes_cpu_us": statistics.median(cpus),
        }
        if all(server is not None for server in servers):
            results[name]["writes_server_us"] = statistics.median(servers)
    return results


def bench_link(store: TrajectoryStore) -> tuple[float, float, float]:
    """(p50 ms, max ms) of warm link_parent over 50 growing turns; cold first call ms."""
    rng = random.Random(1)
    sid = f"link-{uuid.uuid4().hex[:8]}"
    store.add_session(SessionRecord(id=sid))
    linker = ParentLinker(store)
    prompt = _tokens(rng, TOKENS)
    timings, records = [], []
    for turn in range(50):
        output = _tokens(rng, 300)
        record = _record(f"{sid}-{turn}", sid, prompt, output)
        start = time.perf_counter()
        record = linker.link_parent(record)
        timings.append(time.perf_counter() - start)
        assert record.parent_id == (f"{sid}-{turn - 1}" if turn else None)
        records.append(record)
        prompt = prompt + output + _tokens(rng, 700)  # tool result / user turn
    store.add_completions(records)
    cold = ParentLinker(store)
    start = time.perf_counter()
    cold.link_parent(_record(f"{sid}-next", sid, prompt, _tokens(rng, 10)))
    cold_ms = (time.perf_counter() - start) * 1000
    return statistics.median(timings) * 1000, max(timings) * 1000, cold_ms


def _fill_episodes(store: TrajectoryStore, episodes: int) -> None:
    """Ended sessions in groups of 4, one 1k+1k completion and one reward each (bulk
    inserts: the setup is not what is measured)."""
    rng = random.Random(2)
    prompt, output = _tokens(rng, TOKENS), _tokens(rng, TOKENS)
    tag = uuid.uuid4().hex[:8]
    for first in range(0, episodes, 250):
        ids = [f"{tag}-e{i}" for i in range(first, min(first + 250, episodes))]
        with store.engine.begin() as connection:
            connection.execute(
                insert(SessionRow.__table__),
                [
                    {
                        "id": sid,
                        "group_id": f"{tag}-g{(first + k) // 4}",
                        "status": "ended",
                        "metadata": {},
                        "created_at": first + k,
                        "last_activity_at": first + k,
                        "ended_at": first + k + 1,
                        "end_reason": "client",
                    }
                    for k, sid in enumerate(ids)
                ],
            )
        store.add_completions([_record(f"{sid}-c", sid, prompt, output) for sid in ids])
        with store.engine.begin() as connection:
            connection.execute(
                insert(RewardRow.__table__),
                [
                    {
                        "id": f"r-{sid}",
                        "value": k % 2,
                        "name": "reward",
                        "session_id": sid,
                        "metadata": {},
                        "created_at": 0.0,
                    }
                    for k, sid in enumerate(ids)
                ],
            )


def bench_claim(store: TrajectoryStore, episodes: int) -> tuple[float, float]:
    """(episodes/s, CPU µs per episode) claimed and marked trained by one claimer, 32
    groups a call."""
    claimer = EpisodeClaimer(store)
    claimed = 0
    start, cpu = time.perf_counter(), time.process_time()
    while True:
        result = claimer.claim_groups(
            group_size=4, max_groups=32, current_version=4, max_staleness=4, claimer="bench"
        )
        if not result.groups:
            break
        claimed += sum(len(group.session_ids) for group in result.groups)
        claimer.mark_trained([group.claim_id for group in result.groups])  # one per step
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert claimed == episodes, (claimed, episodes)
    return claimed / elapsed, cpu / claimed * 1e6


def bench_export(store: TrajectoryStore) -> float:
    start = time.perf_counter()
    rows = export_sequences(store, fmt="parquet", out=io.BytesIO(), page_size=128)
    return rows / (time.perf_counter() - start)


def run(
    stores: dict[str, TrajectoryStore], args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """Every section on every store: dialect -> metric -> value."""
    results: dict[str, dict[str, float]] = {name: {} for name in stores}
    for name, store in stores.items():
        for size, cpu_us in bench_record_cpu(store).items():
            results[name][f"record_cpu_us_{size}"] = cpu_us
    if args.cpu_only:
        return results
    for name, writes in bench_write_rounds(stores, args).items():
        results[name].update(writes)
    if args.writes_only:
        return results
    for name, store in stores.items():
        row = results[name]
        row["link_p50_ms"], row["link_max_ms"], row["link_cold_ms"] = bench_link(store)
        _fill_episodes(store, args.episodes)
        row["claim"], row["claim_cpu_us"] = bench_claim(store, args.episodes)
        row["export"] = bench_export(store)
    return results


def report(dialect: str, results: dict[str, float], args: argparse.Namespace) -> None:
    """Wall rates can swing with other load on the host; CPU µs per item (all threads of
    this process) does not, and 1e6 / that is the rate one otherwise idle core reaches."""
    print(f"\n{dialect}  (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    cpu = "  ".join(f"{size}: {results[f'record_cpu_us_{size}']:.0f}" for size in CPU_BATCHES)
    print(f"{'add_completions thread CPU µs/record, batch':<44}{cpu:>30}")
    if args.cpu_only:
        return
    print(f"{'metric':<44}{'measured':>10}{'target':>8}{'ratio':>8}{'cpu µs/item':>13}")
    writes = f"completions/s durable ({args.writers} writers, 1k+1k)"
    rows = [(writes, "writes", "writes_postgresql" if dialect == POSTGRES else "writes")]
    if not args.writes_only:
        rows.append((f"episodes/s claimed ({args.episodes}, groups of 4)", "claim", "claim"))
    for label, key, target_key in rows:
        value, target, cpu = results[key], TARGETS[target_key], results[f"{key}_cpu_us"]
        print(f"{label:<44}{value:>10.0f}{target:>8.0f}{value / target:>7.2f}x{cpu:>13.0f}")
    if args.writes_only:
        return
    print(f"{'export rows/s (parquet)':<44}{results['export']:>10.0f}")
    link = "p50 {:.2f}  max {:.2f}  cold {:.2f}".format(
        results["link_p50_ms"], results["link_max_ms"], results["link_cold_ms"]
    )
    print(f"{'link_parent ms, 50 turns to ~50k tokens':<44}{link:>30}")


def compare(results: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    """SQLite and PostgreSQL side by side: the durable write rate (median of the
    alternating rounds), its ratio, and where the CPU goes."""
    lite, pg = results[SQLITE], results[POSTGRES]
    print(
        f"\ndurable completions/s, {args.writers} writers, 1k+1k tokens: median of "
        f"{args.rounds} rounds alternating between the two"
    )
    print(f"{'':<44}{'sqlite':>10}{'postgresql':>12}{'pg/sqlite':>11}")
    ratio = pg["writes"] / lite["writes"]
    print(f"{'completions/s':<44}{lite['writes']:>10.0f}{pg['writes']:>12.0f}{ratio:>10.2f}x")
    cpu_ratio = pg["writes_cpu_us"] / lite["writes_cpu_us"]
    print(
        f"{'client CPU µs/completion (this process)':<44}{lite['writes_cpu_us']:>10.0f}"
        f"{pg['writes_cpu_us']:>12.0f}{cpu_ratio:>10.2f}x"
    )
    server = pg.get("writes_server_us")
    shown = f"{server:.0f}" if server is not None else "n/a (not on this host)"
    print(f"{'server CPU µs/completion':<44}{'-':>10}{shown:>12}")
    target = TARGETS["writes_postgresql"]
    print(f"{'postgresql target':<44}{'':>10}{target:>12.0f}{pg['writes'] / target:>10.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--writers", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="write rounds per dialect")
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--postgres-url", default=None)
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--cpu-only", action="store_true", help="only the record CPU section")
    only.add_argument("--writes-only", action="store_true", help="record CPU and writes only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        urls = {SQLITE: f"sqlite:///{Path(tmp) / 'bench.db'}"}
        if args.postgres_url:
            urls[POSTGRES] = stack.enter_context(
                scratch_postgres_database(args.postgres_url, "areal_bench")
            )
        stores = {name: TrajectoryStore.open(url, StoreConfig()) for name, url in urls.items()}
        for store in stores.values():
            stack.callback(store.close)  # before the database is dropped (LIFO)
        results = run(stores, args)
    for name, measured in results.items():
        report(name, measured, args)
    if args.postgres_url and not args.cpu_only:
        compare(results, args)


if __name__ == "__main__":
    main()
