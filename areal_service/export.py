"""Export of training sequences to JSONL or Parquet, one row per `TrainSequence`.

Streams: sessions are read in keyset pages (created_at, id), each page's completions
and rewards in one query each (store functions: this module runs no SQL), and rows are written as they are built (Parquet: one row
group per page), so memory is bounded by one page whatever the table size. Exports what
exists now and returns; it never waits for episodes to finish. Reads only; the CLI
`areal-service export` and the admin endpoint call in here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

from areal_service.episodes import build_episode
from areal_service.store import TrajectoryStore
from areal_service.store.session_queries import SessionQuery
from areal_service.types import CompletionRecord, SessionRecord, SessionStatus

if TYPE_CHECKING:
    import pyarrow as pa

ExportFormat = Literal["jsonl", "parquet"]


@functools.cache
def parquet_schema() -> pa.Schema:
    """Parquet columns (JSONL rows have the same keys). `messages` is a JSON string in
    Parquet (arbitrary nesting) and a list in JSONL; `reward` is null for a session no
    reward targets when the export's default_reward is None. pyarrow is imported here,
    not at module import: ~40 MB the gateway needs only when someone exports."""
    import pyarrow as pa

    columns: list[tuple[str, pa.DataType]] = [
        ("session_id", pa.string()),
        ("group_id", pa.string()),
        ("task_id", pa.string()),
        ("status", pa.string()),
        ("advantage_group", pa.string()),
        ("sequence_index", pa.int32()),
        ("completion_ids", pa.list_(pa.string())),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())),
        ("versions", pa.list_(pa.int32())),
        ("reward", pa.float64()),
        ("session_return", pa.float64()),
        ("temperature", pa.float64()),
        ("messages", pa.string()),
    ]
    return pa.schema(columns)


EXPORTED: tuple[SessionStatus, ...] = ("ended", "claimed", "trained")
"""The sessions an export holds by default: those that may train."""


@dataclass(frozen=True, slots=True)
class ExportFilters:
    """Which sessions to export (every given condition must hold)."""

    statuses: tuple[SessionStatus, ...] = EXPORTED
    group_id: str | None = None
    task_id: str | None = None
    created_after: float | None = None
    """Only sessions created at or after this time (epoch seconds)."""
    created_before: float | None = None
    """Only sessions created before this time."""

    @classmethod
    def of(
        cls, group_id: str | None = None, task_id: str | None = None, *, dropped: bool = False
    ) -> ExportFilters:
        """The export's filters by group and task; `dropped`: the dropped sessions too
        (e.g. those of a deleted policy: what they recorded before the deletion)."""
        statuses: tuple[SessionStatus, ...] = (*EXPORTED, "dropped") if dropped else EXPORTED
        return cls(statuses=statuses, group_id=group_id, task_id=task_id)

    def query(self) -> SessionQuery:
        """These filters as the store's session query."""
        return SessionQuery(
            statuses=self.statuses,
            group_id=self.group_id,
            task_id=self.task_id,
            created_from=self.created_after,
            created_before=self.created_before,
        )


def transcript(completion: CompletionRecord) -> list[Any]:
    """The conversation of a completion: its request's messages (Chat Completions) or
    instructions + input items (Responses), then the response's message or items."""
    request, response = completion.request_json, completion.response_json
    if "messages" in request:
        messages = list(request["messages"])
    else:
        given = request.get("input") or []
        messages = [{"role": "user", "content": given}] if isinstance(given, str) else list(given)
        if request.get("instructions"):
            messages.insert(0, {"role": "system", "content": request["instructions"]})
    if response.get("choices"):
        messages.append(response["choices"][0].get("message"))
    else:
        messages.extend(response.get("output") or [])
    return messages


def _page_rows(
    store: TrajectoryStore,
    sessions: list[SessionRecord],
    gamma: float,
    default_reward: float | None,
) -> Iterator[dict[str, Any]]:
    ids = [row.id for row in sessions]
    completions = store.load_completions(ids)
    rewards = store.load_rewards(ids, {row.group_id for row in sessions if row.group_id})
    for row in sessions:
        by_id = {c.id: c for c in completions[row.id]}
        episode = build_episode(
            row.id,
            completions[row.id],
            rewards,
            group_id=row.group_id,
            gamma=gamma,
            default_reward=default_reward,
        )
        for index, sequence in enumerate(episode.sequences):
            yield {
                "session_id": row.id,
                "group_id": row.group_id,
                "task_id": row.task_id,
                "status": row.status,
                "advantage_group": row.group_id or row.id,
                "sequence_index": index,
                "completion_ids": list(sequence.completion_ids),
                "input_ids": list(sequence.input_ids),
                "loss_mask": list(sequence.loss_mask),
                "logprobs": list(sequence.logprobs),
                "versions": list(sequence.versions),
                "reward": None if episode.session_return is None else sequence.reward,
                "session_return": episode.session_return,
                "temperature": sequence.temperature,
                "messages": transcript(by_id[sequence.completion_ids[-1]]),
            }


def iter_export_pages(
    store: TrajectoryStore,
    filters: ExportFilters | None = None,
    *,
    page_size: int = 64,
    turn_discount: float = 1.0,
    default_reward: float | None = 0.0,
) -> Iterator[list[dict[str, Any]]]:
    """Rows of `page_size` sessions at a time (see `iter_export_rows`)."""
    if page_size < 1:
        raise ValueError(f"page_size ({page_size}) must be >= 1")
    filters = filters or ExportFilters()
    after: tuple[float, str] | None = None
    while True:
        sessions = store.sessions_after(filters.query(), after, page_size)
        if not sessions:
            return
        yield list(_page_rows(store, sessions, turn_discount, default_reward))
        after = (sessions[-1].created_at, sessions[-1].id)


def iter_export_rows(
    store: TrajectoryStore,
    filters: ExportFilters | None = None,
    *,
    page_size: int = 64,
    turn_discount: float = 1.0,
    default_reward: float | None = 0.0,
) -> Iterator[dict[str, Any]]:
    """One JSON-ready dict per training sequence, sessions oldest first (keys: the
    columns of `parquet_schema()`; `messages` a list). Lazy: a streaming HTTP response can send
    each row as it comes (`json.dumps(row) + "\\n"`)."""
    for page in iter_export_pages(
        store,
        filters,
        page_size=page_size,
        turn_discount=turn_discount,
        default_reward=default_reward,
    ):
        yield from page


def export_sequences(
    store: TrajectoryStore,
    *,
    fmt: ExportFormat,
    out: BinaryIO | str | Path,
    filters: ExportFilters | None = None,
    page_size: int = 64,
    turn_discount: float = 1.0,
    default_reward: float | None = 0.0,
) -> int:
    """Write every matching training sequence to `out` (a path or a binary file, left
    open) as JSONL or Parquet; returns the number of rows. An empty export is an empty
    JSONL file or a Parquet file with the schema and no rows."""
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"export format {fmt!r}: use 'jsonl' or 'parquet'")
    pages = iter_export_pages(
        store,
        filters,
        page_size=page_size,
        turn_discount=turn_discount,
        default_reward=default_reward,
    )
    count = 0
    with ExitStack() as stack:
        sink = out if not isinstance(out, (str, Path)) else stack.enter_context(open(out, "wb"))
        if fmt == "jsonl":
            for page in pages:
                sink.write(b"".join(json.dumps(row).encode() + b"\n" for row in page))
                count += len(page)
            return count
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = parquet_schema()
        writer = stack.enter_context(pq.ParquetWriter(sink, schema))
        for page in (page for page in pages if page):
            for row in page:
                row["messages"] = json.dumps(row["messages"])
            writer.write_table(pa.Table.from_pylist(page, schema=schema))
            count += len(page)
    return count
