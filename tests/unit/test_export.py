"""Export: JSONL and Parquet hold one row per training sequence with masks, logprobs,
versions, returns and messages; keyset pages cover every session exactly once (ties
on created_at included); filters apply; empty exports are valid files."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from areal_service.export import (
    ExportFilters,
    export_sequences,
    iter_export_pages,
    iter_export_rows,
    parquet_schema,
    transcript,
)
from areal_service.store import TrajectoryStore
from areal_service.types import CompletionRecord, RewardRecord, SessionRecord

MESSAGES = [{"role": "user", "content": "2+2?"}]


def add_session(
    store: TrajectoryStore,
    sid: str,
    *,
    at: float,
    group_id: str | None = None,
    task_id: str | None = None,
    turns: int = 2,
    reward: float | None = 1.0,
) -> None:
    store.add_session(
        SessionRecord(
            id=sid, group_id=group_id, task_id=task_id, created_at=at, last_activity_at=at
        )
    )
    prompt: tuple[int, ...] = (1, 2)
    parent = None
    records = []
    for turn in range(turns):
        output = (30 + turn, 40 + turn)
        cid = f"{sid}-{turn}"
        history = MESSAGES + [{"role": "assistant", "content": f"turn {t}"} for t in range(turn)]
        records.append(
            CompletionRecord(
                id=cid,
                model="m",
                prompt_ids=prompt,
                output_ids=output,
                output_logprobs=(-0.5, -0.25),
                output_versions=(turn, turn),
                finish_reason="stop",
                session_id=sid,
                parent_id=parent,
                request_json={"messages": history},
                response_json={
                    "choices": [{"message": {"role": "assistant", "content": f"turn {turn}"}}]
                },
                created_at=at + turn,
            )
        )
        prompt, parent = prompt + output + (9,), cid
    store.add_completions(records)
    if reward is not None:
        store.add_reward(RewardRecord(id=f"r-{sid}", value=reward, session_id=sid))
    store.end_session(sid, "client")


@pytest.fixture
def filled(store: TrajectoryStore) -> TrajectoryStore:
    add_session(store, "a", at=1.0, group_id="g", task_id="t1", reward=2.0)
    add_session(store, "b", at=1.0, group_id="g", task_id="t1", reward=None)  # tie on time
    add_session(store, "c", at=1.0, task_id="t2", turns=1)
    add_session(store, "d", at=5.0, task_id="t2")
    store.add_session(SessionRecord(id="open", created_at=0.5))  # not exported by default
    return store


def test_rows_hold_sequences_returns_and_messages(filled: TrajectoryStore):
    rows = list(iter_export_rows(filled, turn_discount=0.5))
    assert [r["session_id"] for r in rows] == ["a", "b", "c", "d"]
    a = rows[0]
    assert a["completion_ids"] == ["a-0", "a-1"]
    assert a["input_ids"] == [1, 2, 30, 40, 9, 31, 41]
    assert a["loss_mask"] == [0, 0, 1, 1, 0, 1, 1]
    assert a["logprobs"] == [0.0, 0.0, -0.5, -0.25, 0.0, -0.5, -0.25]
    assert a["versions"] == [-1, -1, 0, 0, -1, 1, 1]
    assert a["reward"] == 1.0 and a["session_return"] == 1.0  # 0 + 0.5 * 2
    assert a["group_id"] == "g" and a["advantage_group"] == "g" and a["task_id"] == "t1"
    assert a["messages"] == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "turn 0"},
        {"role": "assistant", "content": "turn 1"},
    ]
    assert rows[1]["reward"] == 0.0  # default reward
    assert rows[2]["advantage_group"] == "c" and rows[2]["group_id"] is None
    unrewarded = list(iter_export_rows(filled, ExportFilters(group_id="g"), default_reward=None))
    assert [r["reward"] for r in unrewarded] == [2.0, None]
    assert set(rows[0]) == set(parquet_schema().names)


def test_keyset_pages_cover_every_session_once(filled: TrajectoryStore):
    pages = list(iter_export_pages(filled, page_size=1))
    assert [[r["session_id"] for r in page] for page in pages] == [["a"], ["b"], ["c"], ["d"]]
    filters = ExportFilters(task_id="t2", created_after=1.0, created_before=5.0)
    assert [r["session_id"] for r in iter_export_rows(filled, filters, page_size=1)] == ["c"]
    every = ExportFilters(statuses=("open", "ended"))  # "open" has no completion: no row
    assert [r["session_id"] for r in iter_export_rows(filled, every)] == ["a", "b", "c", "d"]
    with pytest.raises(ValueError, match="page_size"):
        next(iter_export_pages(filled, page_size=0))


def test_jsonl_and_parquet_files_match_the_rows(filled: TrajectoryStore, tmp_path: Path):
    expected = list(iter_export_rows(filled))
    buffer = io.BytesIO()
    assert export_sequences(filled, fmt="jsonl", out=buffer, page_size=2) == len(expected)
    lines = buffer.getvalue().decode().splitlines()
    assert [json.loads(line) for line in lines] == expected

    path = tmp_path / "out.parquet"
    assert export_sequences(filled, fmt="parquet", out=path, page_size=2) == len(expected)
    parquet = pq.ParquetFile(path)
    assert parquet.schema_arrow == parquet_schema()
    assert parquet.metadata.num_row_groups == 2  # one per page of two sessions
    table = parquet.read().to_pylist()
    for row in table:
        row["messages"] = json.loads(row["messages"])
    assert table == expected

    with pytest.raises(ValueError, match="format"):
        export_sequences(filled, fmt="csv", out=io.BytesIO())  # type: ignore[arg-type]


def test_empty_exports_are_valid(store: TrajectoryStore, tmp_path: Path):
    buffer = io.BytesIO()
    assert export_sequences(store, fmt="jsonl", out=buffer) == 0 and buffer.getvalue() == b""
    path = tmp_path / "empty.parquet"
    assert export_sequences(store, fmt="parquet", out=str(path)) == 0
    assert pq.read_table(path).schema == parquet_schema() and pq.read_table(path).num_rows == 0


def test_transcript_of_a_responses_api_completion():
    record = CompletionRecord(
        id="resp_1",
        model="m",
        prompt_ids=(1,),
        output_ids=(2,),
        output_logprobs=(-1.0,),
        output_versions=(0,),
        finish_reason="stop",
        request_json={"instructions": "Be brief.", "input": "hi"},
        response_json={"output": [{"type": "message", "role": "assistant", "content": []}]},
    )
    assert transcript(record) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": []},
    ]
