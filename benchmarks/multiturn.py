"""A long multi-turn agent through the gateway, token continuity off vs on, in one run:
training tokens per generated token and gateway CPU per turn against context length.

One agent conversation grows turn by turn (a user/tool message of ~`--user-tokens`
tokens, then `--output-tokens` generated) until its context passes `--max-context`
(64k by default). The same conversation is sent to two gateway child processes (the
`gateway_overhead serve` entry), `gateway.continuity.enabled=false` and `=true`, in front
of one echo backend (`engine/echo_backend.py`, a child process): its outputs are
arbitrary ids, which re-tokenize differently from what was sampled, as a sampled policy's
do. The bench tokenizer is `gateway_overhead`'s 32k byte-level BPE with the project's
chat template (the tiny model's context is too short for 64k).

Reported per context length (first turn at or past 1k, 2k, ... 64k tokens):
- trained / generated: tokens the trainer processes (sum of the lengths of the exported
  sequences of the turns so far, `episodes.build_sequences`) per generated token;
- gateway CPU ms per turn (/proc of the gateway process, all threads, mean of 3 turns:
  HTTP, prompt, capture of the O(context) ids, parent linking);
- prompt ms per turn, in this process on the recorded conversation: building the prompt
  ids alone (`Continuity.prompt`), and one Jinja render of the whole conversation (the
  part continuity still pays: O(context)).

Measured (2 shared cores, 900 user + 256 generated tokens a turn, 57 turns to 66k):
trained/generated 138 off vs 4.6 on at 66k (ratio 0.03; one sequence instead of 57);
prompt build 2.96 -> 1.82 ms a turn at 66k (0.61), of which ~0.9 ms is the one Jinja
render that remains; gateway CPU 12.8 -> 11.6 ms a turn (0.90: HTTP parsing of the
re-sent conversation, capture of the O(context) ids and parent linking dominate). Without
continuity the tokenizer's segment cache already keeps BPE work near O(new text) on a
warm gateway, so the CPU gain is modest; the training-token gain is the point.

Run: `python -m benchmarks.multiturn [--max-context 65536] [--user-tokens 900]
[--output-tokens 256]` (about a minute).
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from areal_service.config import StoreConfig, load_config
from areal_service.episodes import build_sequences
from areal_service.store import TrajectoryStore
from areal_service.types import CompletionRecord
from benchmarks.gateway_overhead import (
    ADMIN_KEY,
    MODEL,
    REPO,
    build_bench_tokenizer,
    free_port,
)
from engine.echo_backend import start_echo_backend

BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
WORDS = [
    w
    for w in "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega "
    "river stone cloud ember harbor signal vector prism lantern meadow".split()
]


@dataclass
class Turn:
    context: int
    """Prompt tokens of this turn."""
    cpu_ms: float


def cpu_ns(pid: int) -> int:
    """CPU nanoseconds of every thread of `pid` so far (/proc schedstat: ns resolution;
    /proc stat counts 10 ms ticks, too coarse for one turn)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended
    return total


def start_gateway(
    name: str, *, backend: str, tokenizer: Path, data_dir: Path, continuity: bool
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "benchmarks.gateway_overhead", "serve"]
    for item in (
        f"data_dir={data_dir}",
        f"engine.model={tokenizer}",
        f"gateway.router.backends=[{backend}]",
        f"gateway.port={port}",
        "engine.context_length=200000",
        "log_level=warning",
        f"gateway.auth.admin_key={ADMIN_KEY}",
        "gateway.sampling.mode=client",
        f"gateway.continuity.enabled={str(continuity).lower()}",
    ):
        argv += ["--set", item]
    log = open(data_dir / "gateway.log", "wb")  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {(data_dir / 'gateway.log').read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health/readiness").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not ready")
        time.sleep(0.2)


def user_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randint(0, 99)) for _ in range(words))


def words_for(tokenizer_dir: Path, tokens: int) -> int:
    """How many `user_text` words make about `tokens` tokens."""
    from gateway.tokenizer import ChatTokenizer

    sample = user_text(random.Random(1), 1000)
    return max(
        1, round(tokens * 1000 / len(ChatTokenizer.from_pretrained(tokenizer_dir).encode(sample)))
    )


def run_conversation(
    url: str,
    pid: int,
    *,
    max_context: int,
    user_tokens: int,
    output_tokens: int,
    seed: int,
    words: int,
    turns_limit: int | None,
) -> tuple[str, list[Turn]]:
    """Drive one agent conversation to `max_context` (or `turns_limit` turns); (session
    id, per-turn figures)."""
    rng = random.Random(seed)
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=url, timeout=120) as http:
        started = http.post("/rl/sessions", json={}, headers=admin).json()
        auth = {"authorization": f"Bearer {started['api_key']}"}
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are an agent. " + user_text(rng, words // 4)}
        ]
        turns: list[Turn] = []
        context = 0
        while context < max_context if turns_limit is None else len(turns) < turns_limit:
            messages.append({"role": "user", "content": user_text(rng, words)})
            body = {
                "model": MODEL,
                "messages": messages,
                "max_tokens": output_tokens,
                "temperature": 1.0,
            }
            before = cpu_ns(pid)
            reply = http.post("/v1/chat/completions", json=body, headers=auth)
            cpu = (cpu_ns(pid) - before) / 1e9
            reply.raise_for_status()
            data = reply.json()
            messages.append(data["choices"][0]["message"])
            context = data["usage"]["prompt_tokens"]
            turns.append(Turn(context, cpu * 1000))
        return started["session_id"], turns


class _Replayed:
    """A recorded choice as `Continuity.remember` reads it."""

    def __init__(self, record: CompletionRecord) -> None:
        self.output_ids = record.output_ids
        self._message = record.response_json["choices"][0]["message"]

    def to_message(self) -> dict[str, Any]:
        return self._message


def prompt_costs(
    tokenizer_dir: Path, records: list[CompletionRecord], continuity: bool
) -> tuple[list[float], list[float]]:
    """Per turn: ms to build the prompt ids (fresh tokenizer caches, warmed by the turns
    as in a gateway) and ms of one Jinja render of the whole conversation."""
    from gateway.continuity import Continuity
    from gateway.tokenizer import ChatTokenizer
    from gateway.translate import normalize_messages

    tok = ChatTokenizer.from_pretrained(tokenizer_dir)
    cont = Continuity(tok, enabled=continuity, max_bytes=1 << 30)
    build, render = [], []
    for record in records:
        messages = record.request_json["messages"]
        t0 = time.process_time()
        ids, lineage = cont.prompt("bench" if continuity else None, messages, None, None)
        build.append((time.process_time() - t0) * 1000)
        assert len(ids) == len(record.prompt_ids)
        cont.remember(lineage, [_Replayed(record)], [_Replayed(record)])  # type: ignore[list-item]
        normalized = normalize_messages(messages)
        t0 = time.process_time()
        tok.render(normalized, None)
        render.append((time.process_time() - t0) * 1000)
    return build, render


def trained_per_generated(records: list[CompletionRecord]) -> float:
    sequences = build_sequences(records, {r.id: 0.0 for r in records})
    return sum(len(s.input_ids) for s in sequences) / max(
        1, sum(len(r.output_ids) for r in records)
    )


def at_buckets(turns: list[Turn]) -> dict[int, int]:
    """Bucket -> index of the first turn whose context reaches it."""
    out = {}
    for b in BUCKETS:
        i = next((i for i, t in enumerate(turns) if t.context >= b), None)
        if i is not None:
            out[b] = i
    return out


def mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-context", type=int, default=65536)
    p.add_argument("--user-tokens", type=int, default=900)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument(
        "--tokenizer-dir", default=str(Path(tempfile.gettempdir()) / "areal-bench-tokenizer-32k")
    )
    args = p.parse_args()
    t0 = time.perf_counter()
    tokenizer = build_bench_tokenizer(Path(args.tokenizer_dir))
    work = Path(tempfile.mkdtemp(prefix="areal-multiturn-"))
    backend = start_echo_backend(subprocess_mode=True, tokens=args.output_tokens)
    results: dict[bool, tuple[list[Turn], list[CompletionRecord]]] = {}
    try:
        for continuity in (True, False):  # off replays on's number of turns
            name = "continuity-" + ("on" if continuity else "off")
            proc, url = start_gateway(
                name,
                backend=backend.url,
                tokenizer=tokenizer,
                data_dir=work / name,
                continuity=continuity,
            )
            try:
                session_id, turns = run_conversation(
                    url,
                    proc.pid,
                    max_context=args.max_context,
                    user_tokens=args.user_tokens,
                    output_tokens=args.output_tokens,
                    seed=0,
                    words=words_for(tokenizer, args.user_tokens),
                    turns_limit=None if continuity else len(results[True][0]),
                )
            finally:
                proc.terminate()
                proc.wait(30)
            config = load_config(overrides=[f"data_dir={work / name}"])
            store = TrajectoryStore.open(config.database_url(), StoreConfig())
            try:
                results[continuity] = (turns, store.list_completions(session_id))
            finally:
                store.close()
    finally:
        backend.stop()
    costs = {c: prompt_costs(tokenizer, results[c][1], c) for c in (False, True)}

    off_turns, off_records = results[False]
    on_turns, on_records = results[True]
    print(
        f"\nOne agent conversation, {len(on_turns)} turns ({args.user_tokens} user + "
        f"{args.output_tokens} generated tokens a turn), echo backend, 32k BPE tokenizer."
    )
    print(
        "trained/gen: training tokens (exported sequences) per generated token so far; "
        "gw CPU: gateway process ms per turn (mean of 3); prompt: ms to build the prompt "
        "ids; render: one Jinja render of the conversation (in-process).\n"
    )
    head = (
        f"{'context':>8} {'turn':>5} | {'trained/gen':>19} {'ratio':>6} | "
        f"{'gw CPU ms/turn':>15} {'ratio':>6} | {'prompt ms':>13} {'ratio':>6} | "
        f"{'render ms':>9}"
    )
    print(head)
    print(
        f"{'':>8} {'':>5} | {'off':>9} {'on':>9} {'':>6} | {'off':>7} {'on':>7} {'':>6} | "
        f"{'off':>6} {'on':>6} {'':>6} |"
    )
    print("-" * len(head))
    for i in at_buckets(on_turns).values():
        window = slice(max(0, min(i - 1, len(on_turns) - 3)), i + 2)
        tg_off = trained_per_generated(off_records[: i + 1])
        tg_on = trained_per_generated(on_records[: i + 1])
        cpu_off = mean([t.cpu_ms for t in off_turns[window]])
        cpu_on = mean([t.cpu_ms for t in on_turns[window]])
        pr_off, pr_on = mean(costs[False][0][window]), mean(costs[True][0][window])
        render = mean(costs[True][1][window])
        print(
            f"{on_turns[i].context:>8} {i + 1:>5} | {tg_off:>9.2f} {tg_on:>9.2f} "
            f"{tg_on / tg_off:>6.2f} | {cpu_off:>7.2f} {cpu_on:>7.2f} {cpu_on / cpu_off:>6.2f}"
            f" | {pr_off:>6.2f} {pr_on:>6.2f} {pr_on / max(pr_off, 1e-9):>6.2f} | "
            f"{render:>9.2f}"
        )
    n_off = len(build_sequences(off_records, {r.id: 0.0 for r in off_records}))
    n_on = len(build_sequences(on_records, {r.id: 0.0 for r in on_records}))
    print(
        f"\nSequences exported for the whole conversation: off {n_off}, on {n_on} "
        f"(ratio = on / off). Total {time.perf_counter() - t0:.0f} s."
    )


if __name__ == "__main__":
    main()
