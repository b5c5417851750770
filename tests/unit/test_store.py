"""TrajectoryStore: every record type round-trips, packed arrays are exact, rewards are
idempotent, keys revoke, lists page; on SQLite and (when configured) PostgreSQL."""

from __future__ import annotations

import random
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError, OperationalError

from areal_service.config import StoreConfig
from areal_service.packing import pack_float32, pack_int32, unpack_float32, unpack_int32
from areal_service.store import TrajectoryStore, create_store_engine
from areal_service.store.schema import CompletionRow
from areal_service.types import (
    ApiKeyRecord,
    CompletionRecord,
    RewardRecord,
    SessionRecord,
    TrainStepRecord,
    WeightVersionRecord,
)


def f32(x: float) -> float:
    """The float32 nearest to x, as a Python float (what the store gives back)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def completion(cid: str, n_out: int = 3, session_id: str | None = None, **kw) -> CompletionRecord:
    rng = random.Random(cid)
    return CompletionRecord(
        id=cid,
        model="areal-policy",
        prompt_ids=tuple(rng.randrange(150_000) for _ in range(2 * n_out + 1)),
        output_ids=tuple(rng.randrange(150_000) for _ in range(n_out)),
        output_logprobs=tuple(f32(-rng.random() * 10) for _ in range(n_out)),
        output_versions=tuple(sorted(rng.randrange(5) for _ in range(n_out))),
        finish_reason="stop",
        session_id=session_id,
        **kw,
    )


# Packed arrays.


def test_packing_is_little_endian_4_bytes_and_exact():
    assert pack_int32([1, -1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"
    assert pack_float32([1.0]) == struct.pack("<f", 1.0)
    for values in [(), (0,), (-(2**31), 2**31 - 1), tuple(range(1000))]:
        assert len(pack_int32(values)) == 4 * len(values)
        assert unpack_int32(pack_int32(values)) == values
    logprobs = tuple(f32(-random.Random(0).random() * 20) for _ in range(1000))
    special = (0.0, -0.0, float("-inf"), f32(-1e-30), f32(-3.4e38))
    for values in [(), logprobs, special]:
        assert unpack_float32(pack_float32(values)) == values
    assert unpack_float32(pack_float32([])) == ()


def test_packing_float64_rounds_to_float32_and_rejects_bad_input():
    (back,) = unpack_float32(pack_float32([0.1]))
    assert back != 0.1 and abs(back - 0.1) <= 0.1 * 2**-24
    with pytest.raises(OverflowError):
        pack_int32([2**31])
    with pytest.raises(ValueError):
        unpack_int32(b"\x00\x00\x00")


# Round trips of every record type.


def test_ping_and_latest_train_step(store: TrajectoryStore, tmp_path):
    store.ping()  # readiness probes: a trivial query
    assert store.latest_train_step() is None
    for step in (1, 3, 2):
        store.add_train_step(TrainStepRecord(step=step, version=step, metrics={}))
    assert store.latest_train_step().step == 3
    gone = TrajectoryStore(create_store_engine(f"sqlite:///{tmp_path / 'no' / 'dir.db'}"))
    with pytest.raises(OperationalError):
        gone.ping()


def test_api_key_round_trip_revoke_touch_bind(store: TrajectoryStore):
    key = ApiKeyRecord(
        id="key-1",
        key_hash="ab" * 32,
        display="sk-ar…7sFA",
        name="agent",
        metadata={"team": "rl", "tags": ["a", "b"], "ü": 1.5},
        created_at=1_700_000_000.123456,
    )
    assert store.keys.add_api_key(key) == key
    assert store.keys.get_api_key("key-1") == key
    assert store.keys.find_api_key_by_hash("ab" * 32) == key
    assert store.keys.find_api_key_by_hash("cd" * 32) is None
    with pytest.raises(IntegrityError):  # the hash is unique
        store.keys.add_api_key(ApiKeyRecord(id="key-2", key_hash="ab" * 32, display="x"))

    store.keys.touch_api_keys({"key-1": 1_700_000_100.5})
    store.keys.bind_key_session("key-1", "sess-9")
    got = store.keys.get_api_key("key-1")
    assert got is not None and got.last_used_at == 1_700_000_100.5 and got.session_id == "sess-9"
    store.keys.bind_key_session("key-1", None)
    assert store.keys.get_api_key("key-1").session_id is None

    revoked = store.keys.revoke_api_key("key-1", at=1_700_000_200.0)
    assert revoked is not None and revoked.revoked_at == 1_700_000_200.0
    again = store.keys.revoke_api_key("key-1", at=1_700_000_300.0)
    assert again.revoked_at == 1_700_000_200.0  # the first revocation time stays
    assert store.keys.revoke_api_key("nope") is None
    session_key = ApiKeyRecord(id="key-3", key_hash="ef" * 32, display="y", kind="session")
    store.keys.add_api_key(session_key)
    assert [k.id for k in store.keys.list_api_keys(include_revoked=False)] == ["key-3"]
    assert {k.id for k in store.keys.list_api_keys()} == {"key-1", "key-3"}
    # The user's own keys by kind, whatever number of session keys is newer.
    assert [k.id for k in store.keys.list_api_keys(kinds=("user",), limit=1)] == ["key-1"]
    assert [k.id for k in store.keys.list_api_keys(kinds=("session",))] == ["key-3"]
    assert store.keys.count_api_keys() == 2
    assert store.keys.count_api_keys(kinds=("session",)) == 1


def test_session_round_trip_end_touch_filters(store: TrajectoryStore):
    first = SessionRecord(
        id="s1",
        group_id="g1",
        task_id="t1",
        api_key_id="key-1",
        metadata={"prompt": "2+2?", "nested": {"k": [1, 2]}},
        created_at=100.0,
        last_activity_at=100.0,
    )
    second = SessionRecord(id="s2", group_id="g1", created_at=101.0, last_activity_at=101.0)
    other = SessionRecord(id="s3", group_id="g2", created_at=102.0, last_activity_at=102.0)
    for record in (first, second, other):
        assert store.add_session(record) == record
    assert store.get_session("s1") == first
    assert store.get_session("missing") is None

    ended = store.end_session("s1", "reward", at=200.0)
    assert ended is not None
    assert (ended.status, ended.ended_at, ended.end_reason) == ("ended", 200.0, "reward")
    assert store.end_session("s1", "idle_timeout", at=300.0) == ended  # first reason wins
    assert store.end_session("missing", "client") is None

    assert [s.id for s in store.list_sessions(group_id="g1")] == ["s2", "s1"]  # newest first
    assert [s.id for s in store.list_sessions(status="open")] == ["s3", "s2"]
    assert [s.id for s in store.list_sessions(status="ended", task_id="t1")] == ["s1"]
    assert store.count_sessions() == 3
    assert store.count_sessions(status="open", group_id="g1") == 1


def test_completion_round_trip_with_1k_and_empty_arrays(store: TrajectoryStore):
    store.add_session(SessionRecord(id="s1", created_at=10.0, last_activity_at=10.0))
    long = completion(
        "chatcmpl-long",
        n_out=1000,
        session_id="s1",
        api_key_id="key-1",
        request_json={"messages": [{"role": "user", "content": "hi ✓"}], "tools": []},
        response_json={"choices": [{"message": {"content": "x"}}]},
        temperature=0.7,
        top_p=0.95,
        top_k=40,
        backend="http://127.0.0.1:30000",
        latency_ms=12.5,
        prompt_tokens=2001,
        completion_tokens=1000,
        created_at=20.0,
    )
    empty = CompletionRecord(
        id="chatcmpl-empty",
        model="m",
        prompt_ids=(),
        output_ids=(),
        output_logprobs=(),
        output_versions=(),
        finish_reason="length",
        session_id="s1",
        parent_id="chatcmpl-long",
        created_at=21.0,
    )
    store.add_completions([long, empty])
    assert store.get_completion("chatcmpl-long") == long
    assert store.get_completion("chatcmpl-empty") == empty
    assert store.get_completion("missing") is None
    assert store.list_completions("s1") == [long, empty]
    assert store.list_completions("s1", limit=1, offset=1) == [empty]
    assert store.list_completions("other") == []
    # The batch advanced the session's activity time to its newest completion.
    assert store.get_session("s1").last_activity_at == 21.0
    with store.engine.connect() as connection:
        rows = dict(connection.execute(select(CompletionRow.id, CompletionRow.min_version)).all())
        blob = connection.execute(
            select(CompletionRow.output_logprobs).where(CompletionRow.id == "chatcmpl-long")
        ).scalar_one()
    assert rows == {"chatcmpl-long": min(long.output_versions), "chatcmpl-empty": None}
    assert len(blob) == 4 * 1000  # packed float32, not JSON


def test_completion_batch_is_atomic(store: TrajectoryStore):
    good = completion("c-good")
    mismatched = CompletionRecord(
        id="c-bad",
        model="m",
        prompt_ids=(1,),
        output_ids=(2, 3),
        output_logprobs=(-1.0,),
        output_versions=(0, 0),
        finish_reason="stop",
    )
    with pytest.raises(ValueError, match="one entry per output token"):
        store.add_completions([good, mismatched])
    with pytest.raises(IntegrityError):  # duplicate id inside one batch
        store.add_completions([good, completion("c-good")])
    with pytest.raises(IntegrityError):  # the session does not exist (foreign key)
        store.add_completions([completion("c-orphan", session_id="no-such-session")])
    assert store.get_completion("c-good") is None  # nothing of a failed batch landed
    store.add_completion(good)
    assert store.get_completion("c-good") == good


def test_reward_is_idempotent_by_id_and_filters(store: TrajectoryStore):
    store.add_session(SessionRecord(id="s1", group_id="g1"))
    store.add_completion(completion("c1", session_id="s1"))
    on_completion = RewardRecord(
        id="r1", value=0.5, name="format", completion_id="c1", metadata={"judge": "regex"}
    )
    assert store.add_reward(on_completion) == on_completion
    retry = RewardRecord(id="r1", value=99.0, completion_id="c1")
    assert store.add_reward(retry) == on_completion  # stored record, first write wins
    on_session = RewardRecord(id="r2", value=1.0, session_id="s1", group_id="g1", created_at=1e10)
    store.add_reward(on_session)
    assert store.list_rewards(completion_id="c1") == [on_completion]
    assert store.list_rewards(session_id="s1") == [on_session]
    assert store.list_rewards(group_id="g1") == [on_session]
    assert store.list_rewards() == [on_completion, on_session]
    assert store.list_rewards(limit=1, offset=1) == [on_session]
    with pytest.raises(IntegrityError):  # rewards must name an existing completion
        store.add_reward(RewardRecord(id="r3", value=1.0, completion_id="missing"))
    assert store.get_reward("r3") is None


def test_weight_versions(store: TrajectoryStore):
    assert store.latest_weight_version() is None
    v0 = WeightVersionRecord(version=0, path="/w/v0", created_at=1.0)
    v1 = WeightVersionRecord(version=1, path="/w/v1", created_at=2.0, metadata={"a": 1})
    store.add_weight_version(v1)
    store.add_weight_version(v0)
    assert store.latest_weight_version() == v1
    assert store.list_weight_versions() == [v1, v0]
    assert store.get_weight_version(0) == v0
    with pytest.raises(IntegrityError):
        store.add_weight_version(WeightVersionRecord(version=1, path="/elsewhere"))
    merged = store.update_weight_version_metadata(1, {"swap": {"b0": {"pause_ms": 3.0}}})
    assert merged is not None and merged.metadata == {"a": 1, "swap": {"b0": {"pause_ms": 3.0}}}
    assert store.update_weight_version_metadata(1, {"a": 2}).metadata["a"] == 2
    assert store.get_weight_version(1).metadata == {"a": 2, "swap": {"b0": {"pause_ms": 3.0}}}
    assert store.update_weight_version_metadata(7, {"x": 1}) is None
    # the version the leader made live, above what a follower already adopted
    assert store.live_weight_version() is None  # nothing swapped yet
    store.add_weight_version(WeightVersionRecord(version=2, path="/w/v2"))
    store.update_weight_version_metadata(1, {"live_at": 5.0})
    assert store.live_weight_version().version == 1  # v2 published, not live yet
    assert store.live_weight_version(after=1) is None
    store.update_weight_version_metadata(2, {"live_at": 6.0})
    assert store.live_weight_version(after=1).version == 2


def test_concurrent_metadata_merges_lose_nothing(store: TrajectoryStore):
    store.add_weight_version(WeightVersionRecord(version=3, path="/w/v3"))

    def merge(backend: int) -> None:
        for phase in range(5):
            store.update_weight_version_metadata(3, {f"b{backend}.p{phase}": phase})

    with ThreadPoolExecutor(max_workers=6) as pool:
        list(pool.map(merge, range(6)))
    assert len(store.get_weight_version(3).metadata) == 6 * 5


def test_train_steps_and_pagination(store: TrajectoryStore):
    steps = [
        TrainStepRecord(step=i, version=i + 1, metrics={"loss": 0.5 / (i + 1), "kl": 0.0})
        for i in range(25)
    ]
    for record in reversed(steps):
        assert store.add_train_step(record) == record
    assert store.list_train_steps() == steps
    pages = [store.list_train_steps(limit=10, offset=o) for o in (0, 10, 20)]
    assert [len(p) for p in pages] == [10, 10, 5]
    assert sum(pages, []) == steps
    assert store.list_train_steps(after_step=22) == steps[23:]
    with pytest.raises(ValueError):
        store.list_train_steps(limit=-1)


def test_session_pages_do_not_overlap(store: TrajectoryStore):
    for i in range(25):
        store.add_session(SessionRecord(id=f"s{i:02d}", created_at=1000.0 + i))
    pages = [store.list_sessions(limit=10, offset=o) for o in (0, 10, 20, 30)]
    assert [len(p) for p in pages] == [10, 10, 5, 0]
    ids = [s.id for page in pages for s in page]
    assert ids == [f"s{i:02d}" for i in reversed(range(25))]


# Engine settings.


def test_sqlite_pragmas(tmp_path):
    store = TrajectoryStore.open(
        f"sqlite:///{tmp_path / 'p.db'}", StoreConfig(sqlite_synchronous="FULL")
    )
    with store.engine.connect() as connection:
        pragma = {
            name: connection.execute(text(f"PRAGMA {name}")).scalar_one()
            for name in ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")
        }
    store.close()
    assert pragma == {
        "journal_mode": "wal",
        "synchronous": 2,
        "foreign_keys": 1,
        "busy_timeout": 30000,
    }


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_in_memory_sqlite_is_refused(url):
    with pytest.raises(ValueError, match="SQLite file"):
        create_store_engine(url)


def test_batched_key_and_session_reads(store: TrajectoryStore):
    """`find_api_keys_by_hashes` / `get_sessions`: one query for several rows (the
    gateway's caches reload every stale entry with them); unknown ones are absent."""
    keys = [ApiKeyRecord(id=f"key-{i}", key_hash=f"{i:064x}", display="x") for i in range(3)]
    for key in keys:
        store.keys.add_api_key(key)
    assert store.keys.find_api_keys_by_hashes([k.key_hash for k in keys] + ["ee" * 32]) == {
        k.key_hash: k for k in keys
    }
    assert store.keys.find_api_keys_by_hashes([]) == {}
    sessions = [
        SessionRecord(id=f"s{i}", created_at=1.0 + i, last_activity_at=1.0 + i) for i in range(3)
    ]
    for session in sessions:
        store.add_session(session)
    assert store.get_sessions(["s0", "s2", "nope"]) == {"s0": sessions[0], "s2": sessions[2]}
    assert store.get_sessions([]) == {}
