"""Episodes: parent linking by prefix hash (warm and cold), training sequences merged
from real chat-template token ids (chaining and think-stripping templates), branches and
breaks, discounted returns in closed form, and the 0002 hash backfill."""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from pathlib import Path

import pytest
from sqlalchemy import column, insert, select, table
from transformers import AutoTokenizer

from areal_service.config import StoreConfig
from areal_service.episodes import build_episode, build_sequences, compute_returns, missing_part
from areal_service.packing import pack_float32, pack_int32
from areal_service.store import TrajectoryStore, upgrade_database
from areal_service.store.linking import ParentLinker, PrefixEntry, match_parent, token_digest
from areal_service.store.schema import CompletionRow, SessionRow
from areal_service.types import CompletionRecord, RewardRecord, SessionRecord


def completion(
    cid: str,
    prompt: tuple[int, ...],
    output: tuple[int, ...],
    *,
    at: float,
    session_id: str | None = "s1",
    parent_id: str | None = None,
    version: int = 0,
    temperature: float = 1.0,
) -> CompletionRecord:
    return CompletionRecord(
        id=cid,
        model="m",
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=tuple(-0.25 * (i + 1) for i in range(len(output))),
        output_versions=(version,) * len(output),
        finish_reason="stop",
        session_id=session_id,
        parent_id=parent_id,
        temperature=temperature,
        created_at=at,
    )


def entry(record: CompletionRecord) -> PrefixEntry:
    full = record.prompt_ids + record.output_ids
    return PrefixEntry(record.id, len(full), token_digest(full), record.created_at)


# Parent matching.


def test_match_parent_longest_prefix_newest_on_ties():
    a = completion("a", (1, 2), (3,), at=1.0)
    b = completion("b", (1, 2, 3, 4), (5, 6), at=2.0)
    twin = completion("twin", (1, 2, 3, 4), (5, 6), at=3.0)  # same tokens, newer
    other = completion("other", (9, 9), (9,), at=4.0)
    entries = [entry(r) for r in (a, b, twin, other)]
    assert match_parent((1, 2, 3, 4, 5, 6, 7), entries) == "twin"
    assert match_parent((1, 2, 3, 4, 5, 7), entries) == "a"  # b's output differs
    assert match_parent((1, 2, 3), entries) == "a"  # exact: no glue after the parent
    assert match_parent((1, 2), entries) is None  # shorter than every parent
    assert match_parent((7, 1, 2, 3), entries) is None  # not a prefix
    empty = PrefixEntry("empty", 0, token_digest(()), 5.0)
    assert match_parent((1,), [empty]) is None  # an empty completion is nobody's parent


def test_match_parent_agrees_with_the_rule_on_random_sessions():
    """The length index finds what the rule says (longest prefix, newest on ties) on
    random sessions with shared prefixes, repeats and out-of-order creation times."""
    rng = random.Random(7)
    for _ in range(200):
        records, entries = [], []
        for k in range(rng.randint(0, 30)):
            base = (
                rng.choice(records).prompt_ids + rng.choice(records).output_ids
                if records and rng.random() < 0.6
                else ()
            )
            prompt = base + tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 3)))
            output = tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 2)))
            records.append(completion(f"c{k}", prompt, output, at=rng.choice([1.0, 2.0, k])))
            entries.append(entry(records[-1]))
        prompt = tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 8)))
        if records and rng.random() < 0.7:
            r = rng.choice(records)
            prompt = r.prompt_ids + r.output_ids + prompt
        matches = [
            r
            for r in records
            if 0 < len(r.prompt_ids + r.output_ids) <= len(prompt)
            and prompt[: len(r.prompt_ids + r.output_ids)] == r.prompt_ids + r.output_ids
        ]
        best = max(
            matches, key=lambda r: (len(r.prompt_ids + r.output_ids), r.created_at), default=None
        )
        found = match_parent(prompt, entries)
        if best is None:
            assert found is None
        else:  # ties on (length, time) may pick either twin: same tokens, same time
            twin = next(r for r in records if r.id == found)
            assert (twin.prompt_ids + twin.output_ids, twin.created_at) == (
                best.prompt_ids + best.output_ids,
                best.created_at,
            )


def test_linker_links_remembers_and_cold_start_reads_the_store(store: TrajectoryStore):
    store.add_session(SessionRecord(id="s1"))
    linker = ParentLinker(store)
    first = linker.link_parent(completion("c1", (1, 2, 3), (4, 5), at=1.0))
    assert first.parent_id is None
    # The next turn is linked before c1 is even written (the gateway writes after).
    second = linker.link_parent(completion("c2", (1, 2, 3, 4, 5, 6, 7), (8,), at=2.0))
    assert second.parent_id == "c1"
    store.add_completions([first, second])
    third = completion("c3", (1, 2, 3, 4, 5, 6, 7, 8, 9), (10,), at=3.0)
    cold = ParentLinker(store)  # a restarted gateway: nothing cached
    assert cold.link_parent(third).parent_id == "c2"
    assert linker.link_parent(third).parent_id == "c2"
    assert ParentLinker(store, max_sessions=0).find_parent("s1", (1, 2, 3, 4, 5, 0)) == "c1"
    explicit = completion("c4", (1, 2, 3, 4, 5, 6), (0,), at=4.0, parent_id="c2")
    assert linker.link_parent(explicit).parent_id == "c2"  # the caller's parent is kept
    alone = completion("x", (1, 2, 3, 4, 5), (6,), at=5.0, session_id=None)
    assert linker.link_parent(alone) is alone
    assert cold.find_parent("unknown-session", (1, 2, 3)) is None


def test_processes_sharing_a_store_link_in_the_writer_batch(store: TrajectoryStore):
    """Two gateway processes (each a linker with no cache and a writer that links per
    batch) serve alternate turns of one session: every turn links to the previous one,
    whichever process wrote it; turns in one batch see each other."""
    from areal_service.store.writer import GroupCommitWriter

    store.add_session(SessionRecord(id="s1"))
    store.add_session(SessionRecord(id="s2"))
    writers = []
    for _ in range(2):
        linker = ParentLinker(store, max_sessions=0)
        writer = GroupCommitWriter(store, interval_ms=0, prepare=linker.link_batch)
        writer.start()
        writers.append(writer)
    try:
        prompt: tuple[int, ...] = (1, 2)
        for turn in range(6):
            writers[turn % 2].submit(
                completion(f"t{turn}", prompt, (10 + turn,), at=float(turn))
            ).result(10)
            prompt = (*prompt, 10 + turn, 50 + turn)
        # One batch holding a first turn and its sibling from a second session.
        batch = [
            completion("a", (7, 8), (9,), at=10.0, session_id="s2"),
            completion("b", (7, 8, 9, 1), (2,), at=11.0, session_id="s2"),
        ]
        assert [r.parent_id for r in writers[0].prepare(batch)] == [None, "a"]
    finally:
        for writer in writers:
            writer.stop()
    parents = {c.id: c.parent_id for c in store.list_completions("s1")}
    assert parents == {"t0": None, **{f"t{i}": f"t{i - 1}" for i in range(1, 6)}}


async def test_alink_parent_miss_then_hit(store: TrajectoryStore):
    store.add_session(SessionRecord(id="s1"))
    store.add_completion(completion("c1", (1, 2), (3,), at=1.0))
    linker = ParentLinker(store, max_sessions=1)
    linked = await linker.alink_parent(completion("c2", (1, 2, 3, 4), (5,), at=2.0))
    assert linked.parent_id == "c1"
    linked = await linker.alink_parent(completion("c3", (1, 2, 3, 4, 5, 6), (7,), at=3.0))
    assert linked.parent_id == "c2"  # from the cache: c2 is not in the store
    store.add_session(SessionRecord(id="s2"))
    await linker.alink_parent(completion("d1", (1,), (2,), at=4.0, session_id="s2"))
    # max_sessions=1 evicted s1; its store rows (c1 only) are what a miss sees.
    assert linker.find_parent("s1", (1, 2, 3, 4, 5, 6, 7, 8)) == "c1"


def test_link_parent_is_cheap_for_50_turns_of_1k_tokens(store: TrajectoryStore):
    """Cost must not grow like turns x tokens (comparing with every earlier turn): a
    50-turn session whose prompt grows by 1k tokens a turn (50k at the end)."""
    store.add_session(SessionRecord(id="s1"))
    linker = ParentLinker(store)
    prompt: tuple[int, ...] = tuple(range(500))
    timings = []
    for turn in range(50):
        output = tuple(range(1000 + turn * 10, 1000 + turn * 10 + 500))
        record = completion(f"t{turn}", prompt, output, at=float(turn))
        start = time.perf_counter()
        linked = linker.link_parent(record)
        timings.append(time.perf_counter() - start)
        assert linked.parent_id == (f"t{turn - 1}" if turn else None)
        prompt = prompt + output + (7, 7)
    assert statistics.median(timings) < 0.02, timings


# Sequences from real chat templates.

THINK_STRIPPING = """\
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{%- set content = message.content -%}
{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""
"""Qwen3-style: earlier assistant turns lose their <think>...</think> block."""

REPLIES = [
    "<think>\nfirst add\n</think>\n\nThe answer is 4.",
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>',
    "<think>\nso the sum\n</think>\n\nThe total is 4.",
]
FOLLOW_UPS = [
    {"role": "user", "content": "Check it with the tool."},
    {"role": "tool", "content": "4"},
]


def _run_agent(tokenizer, template: str | None) -> list[CompletionRecord]:
    """Three turns as the gateway records them: prompt ids from the template, output
    ids as generated (reply tokens + <|im_end|>), parents by `match_parent`."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    records: list[CompletionRecord] = []
    entries: list[PrefixEntry] = []
    for turn, reply in enumerate(REPLIES):
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, chat_template=template
        )
        prompt = tuple(tokenizer.encode(text, add_special_tokens=False))
        output = tuple(tokenizer.encode(reply, add_special_tokens=False)) + (eos,)
        parent = match_parent(prompt, entries)
        record = completion(f"c{turn}", prompt, output, at=float(turn), version=turn)
        record = dataclasses.replace(record, parent_id=parent)
        records.append(record)
        entries.append(entry(record))
        messages = [*messages, {"role": "assistant", "content": reply}]
        if turn < len(FOLLOW_UPS):
            messages.append(FOLLOW_UPS[turn])
    return records


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_our_template_chains_turns_into_one_masked_sequence(tokenizer):
    records = _run_agent(tokenizer, None)
    assert [r.parent_id for r in records] == [None, "c0", "c1"]
    returns = {r.id: 1.0 for r in records}
    (sequence,) = build_sequences(records, returns, group_id="g")
    last = records[-1]
    assert sequence.input_ids == last.prompt_ids + last.output_ids  # no retokenization
    assert sequence.completion_ids == ("c0", "c1", "c2") and sequence.group_id == "g"
    size = len(sequence.input_ids)
    assert len(sequence.loss_mask) == len(sequence.logprobs) == len(sequence.versions) == size
    expected_mask = [0] * size
    for r in records:
        start = len(r.prompt_ids)
        expected_mask[start : start + len(r.output_ids)] = [1] * len(r.output_ids)
        span = slice(start, start + len(r.output_ids))
        assert sequence.input_ids[span] == r.output_ids
        assert sequence.logprobs[span] == r.output_logprobs
        assert sequence.versions[span] == r.output_versions
    assert list(sequence.loss_mask) == expected_mask
    assert sum(sequence.loss_mask) == sum(len(r.output_ids) for r in records)
    # Everything not generated (prompt, user turn, tool result, glue) is inert.
    for mask, logprob, version in zip(
        sequence.loss_mask, sequence.logprobs, sequence.versions, strict=True
    ):
        if not mask:
            assert (logprob, version) == (0.0, -1)
    tool_text = tokenizer.decode(sequence.input_ids[len(records[1].prompt_ids) :])
    assert "<tool_response>\n4\n</tool_response>" in tool_text


def test_think_stripping_template_breaks_the_chain(tokenizer):
    records = _run_agent(tokenizer, THINK_STRIPPING)
    # Turn 1 follows a reply with <think>: its history differs, so no parent. Turn 2
    # follows a tool-call reply (nothing to strip), so it does chain onto turn 1.
    assert [r.parent_id for r in records] == [None, None, "c1"]
    sequences = build_sequences(records, {"c0": 3.0, "c1": 2.0, "c2": 1.0})
    assert [s.completion_ids for s in sequences] == [("c0",), ("c1", "c2")]
    assert [s.reward for s in sequences] == [3.0, 2.0]
    first = sequences[0]
    assert first.input_ids == records[0].prompt_ids + records[0].output_ids
    assert sum(first.loss_mask) == len(records[0].output_ids)


# Branches, breaks and temperatures (synthetic ids).


def test_branches_train_the_shared_prefix_once():
    root = completion("p", (1, 2), (3, 4), at=1.0)
    left = completion("a", (1, 2, 3, 4, 9), (5,), at=2.0, parent_id="p")
    right = completion("b", (1, 2, 3, 4, 8), (6, 6), at=3.0, parent_id="p")
    sequences = build_sequences([right, left, root], {"p": 1.0, "a": 2.0, "b": 3.0})
    assert [s.completion_ids for s in sequences] == [("p", "a"), ("b",)]
    assert sequences[0].loss_mask == (0, 0, 1, 1, 0, 1)
    assert sequences[1].input_ids == (1, 2, 3, 4, 8, 6, 6)
    assert sequences[1].loss_mask == (0, 0, 0, 0, 0, 1, 1)  # p's tokens: context only
    assert [s.reward for s in sequences] == [1.0, 3.0]


def test_wrong_link_or_new_temperature_starts_a_new_sequence():
    root = completion("p", (1, 2), (3,), at=1.0)
    wrong = completion("w", (1, 2, 4), (5,), at=2.0, parent_id="p")  # prefix broken
    hot = completion("h", (1, 2, 4, 5), (6,), at=3.0, parent_id="w", temperature=0.7)
    missing = completion("m", (1, 2, 3), (7,), at=4.0, parent_id="gone")
    returns = dict.fromkeys("pwhm", 0.5)
    sequences = build_sequences([root, wrong, hot, missing], returns)
    assert [s.completion_ids for s in sequences] == [("p",), ("w",), ("h",), ("m",)]
    assert sequences[2].temperature == 0.7
    assert missing_part([root, wrong, hot, missing]) == "missing parent gone of m"
    assert missing_part([root, wrong]) is None
    assert missing_part([]) == "no completions"


# Returns.


def reward(rid: str, value: float, **target) -> RewardRecord:
    return RewardRecord(id=rid, value=value, **target)


def test_discounted_returns_closed_form():
    c1, c2, c3 = (completion(f"c{i}", (i,), (i,), at=float(i)) for i in (1, 2, 3))
    rewards = [
        reward("r1", 1.0, completion_id="c1"),
        reward("r2", 1.5, session_id="s1", name="correct"),
        reward("r3", 0.5, session_id="s1", name="format"),  # named rewards add up
        reward("r4", 9.0, session_id="other"),
        reward("r5", 9.0, completion_id="elsewhere"),
    ]
    returns = compute_returns([c3, c1, c2], rewards, gamma=0.5)  # any input order
    # r = (1, 0, 2): R3 = 2, R2 = 0 + 0.5*2 = 1, R1 = 1 + 0.5*1 = 1.5
    assert returns == {"c3": 2.0, "c2": 1.0, "c1": 1.5}
    assert compute_returns([c1, c2, c3], rewards, gamma=1.0) == {"c3": 2.0, "c2": 2.0, "c1": 3.0}
    group = [reward("g", 4.0, group_id="g1")]
    assert compute_returns([c1, c2], group, group_id="g1", gamma=0.5) == {"c2": 4.0, "c1": 2.0}
    assert compute_returns([c1, c2], group, group_id=None, default_reward=-1.0) == {
        "c2": -1.0,
        "c1": -1.0,
    }
    assert compute_returns([c1], [], default_reward=None) is None
    assert compute_returns([], rewards) == {}


def test_build_episode_marks_unrewarded_and_broken_sessions():
    c1 = completion("c1", (1,), (2,), at=1.0)
    c2 = completion("c2", (1, 2, 3), (4,), at=2.0, parent_id="c1")
    rewarded = build_episode("s1", [c2, c1], [reward("r", 2.0, session_id="s1")], gamma=0.5)
    assert rewarded.session_return == 1.0 and rewarded.problem is None
    assert [s.reward for s in rewarded.sequences] == [1.0]
    unrewarded = build_episode("s1", [c1, c2], [], default_reward=None)
    assert unrewarded.session_return is None and len(unrewarded.sequences) == 1
    broken = build_episode("s1", [c2], [])
    assert broken.problem == "missing parent c1 of c2"


# Migration 0002 backfills the prefix hash of completions written before it.


def test_0002_backfills_prefix_hashes(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade_database(url, "0001_initial")
    store = TrajectoryStore.open(url, StoreConfig(auto_migrate=False))
    prompt, output = (5, 6, 7), (8, 9)
    session = {"id": "s1", "status": "open", "metadata": {}, "created_at": 1.0}
    row = {
        "id": "old",
        "session_id": "s1",
        "model": "m",
        "request_json": {},
        "response_json": {},
        "prompt_ids": pack_int32(prompt),
        "output_ids": pack_int32(output),
        "output_logprobs": pack_float32([-1.0, -1.0]),
        "output_versions": pack_int32([0, 0]),
        "finish_reason": "stop",
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "backend": "",
        "latency_ms": 0.0,
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "created_at": 1.0,
    }
    session["last_activity_at"] = 1.0
    with store.engine.begin() as connection:  # only 0001's columns are named: not the
        # ORM tables, whose later columns' defaults would be inserted too
        for orm, values in ((SessionRow, session), (CompletionRow, row)):
            types = orm.__table__.c
            old_table = table(orm.__tablename__, *(column(k, types[k].type) for k in values))
            connection.execute(insert(old_table).values(**values))
    store.close()
    upgrade_database(url)
    store = TrajectoryStore.open(url, StoreConfig())
    with store.engine.connect() as connection:
        got = connection.execute(select(CompletionRow.full_len, CompletionRow.full_hash)).one()
    assert tuple(got) == (5, token_digest(prompt + output))
    assert ParentLinker(store).find_parent("s1", (5, 6, 7, 8, 9, 1)) == "old"
    store.close()
