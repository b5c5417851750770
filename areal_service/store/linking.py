"""Parent linking of completions (write side of episodes): digests, prefix entries, and
`ParentLinker`, which sets `parent_id` on a completion before the gateway writes it.

Parent rule: a completion's parent is the earlier completion of its session whose
prompt_ids + output_ids is the longest exact prefix of its prompt_ids (newest on ties).
Compared by blake2b-128 of packed int32 bytes, never element by element; the store keeps
that digest per completion (`full_hash`, see `inserts.py`). Returns and training
sequences are `areal_service.episodes`'s (the read side, which imports no store code).
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from areal_service.types import CompletionRecord

DIGEST_SIZE = 16
"""blake2b digest bytes (128 bits: a false prefix match needs a hash collision)."""


_GIL_SLICE = 2032
"""hashlib releases the GIL for inputs of 2 KiB and more; a few µs of hashing is not
worth it: getting the GIL back waits for the other thread (the store writer, the event
loop) to yield, up to the 5 ms switch interval. Slices below the threshold keep it."""


def _feed(hasher: Any, data: bytes | memoryview) -> None:
    if len(data) <= _GIL_SLICE:  # the common short turn: no slicing
        hasher.update(data)
        return
    view = memoryview(data)
    for start in range(0, len(view), _GIL_SLICE):
        hasher.update(view[start : start + _GIL_SLICE])


def packed_digest(*chunks: bytes) -> str:
    """Hex blake2b-128 of the concatenated packed int32 chunks (no copy is made)."""
    hasher = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for chunk in chunks:
        _feed(hasher, chunk)
    return hasher.hexdigest()


def _pack(ids: Sequence[int]) -> bytes:
    """Exactly `packing.pack_int32(ids)` (int32 LE), about twice as fast for tuples."""
    return struct.pack(f"<{len(ids)}i", *ids)


def token_digest(ids: Sequence[int]) -> str:
    """Hex blake2b-128 of `ids` packed as int32 LE (what the store keeps in full_hash)."""
    return packed_digest(_pack(ids))


@dataclass(frozen=True, slots=True)
class PrefixEntry:
    """What parent linking knows about a completion: len and hash of prompt+output."""

    completion_id: str
    length: int
    digest: str
    created_at: float


class PrefixIndex:
    """A session's prefix entries by length, then digest: the candidates for a prompt of
    n tokens are the lengths <= n, found by bisection, and each length is checked with
    one digest lookup. A session that grows to N turns (an `auto_session` key serves
    every request of its key in one session) therefore costs a request O(log N + lengths
    <= n), not O(N): scanning and sorting every entry per request was quadratic over the
    session's life (measured: 20% of the gateway's CPU after a few thousand turns).

    Of entries with the same length and digest (the same prompt+output generated twice)
    the newest is kept: the parent rule's tie-break. Mutated under `ParentLinker`'s lock;
    `candidates` copies the lengths it returns, so a scan outside the lock sees a
    consistent list while other turns are added (dict lookups are atomic)."""

    __slots__ = ("_by_length", "_lengths")

    def __init__(self, entries: Iterable[PrefixEntry] = ()) -> None:
        self._lengths: list[int] = []
        """Distinct lengths > 0, ascending (empty completions are nobody's parent)."""
        self._by_length: dict[int, dict[str, PrefixEntry]] = {}
        for entry in entries:
            self.add(entry)

    def add(self, entry: PrefixEntry) -> None:
        if entry.length <= 0:
            return
        group = self._by_length.get(entry.length)
        if group is None:
            group = self._by_length[entry.length] = {}
            bisect.insort(self._lengths, entry.length)
        kept = group.get(entry.digest)
        if kept is None or entry.created_at >= kept.created_at:
            group[entry.digest] = entry

    def candidates(self, size: int) -> list[int]:
        """The lengths a prompt of `size` tokens may extend, ascending (a copy)."""
        return self._lengths[: bisect.bisect_right(self._lengths, size)]

    def at(self, length: int, digest: str) -> PrefixEntry | None:
        group = self._by_length.get(length)
        return None if group is None else group.get(digest)


def _scan(
    packed_prompt: memoryview, packed_output: bytes, index: PrefixIndex, lengths: list[int]
) -> tuple[str | None, str]:
    """(parent id, digest of prompt+output) in ONE blake2b pass: the hash state is
    copied at each candidate length (`lengths`, ascending, from `index.candidates`), so
    the cost is O(prompt + output + lengths), however many earlier turns there are."""
    hasher = hashlib.blake2b(digest_size=DIGEST_SIZE)
    fed = 0
    best: str | None = None
    for length in lengths:
        _feed(hasher, packed_prompt[4 * fed : 4 * length])
        fed = length
        entry = index.at(length, hasher.copy().hexdigest())
        if entry is not None:
            best = entry.completion_id  # later lengths are longer
    _feed(hasher, packed_prompt[4 * fed :])
    _feed(hasher, packed_output)
    return best, hasher.hexdigest()


def match_parent(prompt_ids: Sequence[int], entries: Iterable[PrefixEntry]) -> str | None:
    """The id of the longest entry (newest on ties) whose prompt+output is a prefix of
    `prompt_ids`, or None."""
    index = PrefixIndex(entries)
    return _scan(memoryview(_pack(prompt_ids)), b"", index, index.candidates(len(prompt_ids)))[0]


class PrefixSource(Protocol):
    """Where a linker loads a session's prefix entries on a cache miss (the store's
    `TrajectoryStore.prefix_entries`; a protocol so this module needs no store import)."""

    def prefix_entries(self, session_id: str) -> list[PrefixEntry]: ...

    def prefix_entries_of(self, session_ids: Collection[str]) -> dict[str, list[PrefixEntry]]: ...


def _linked(
    record: CompletionRecord, index: PrefixIndex, lengths: list[int]
) -> tuple[CompletionRecord, PrefixEntry]:
    """`record` with its parent among `index`'s entries of `lengths` (an explicit
    parent_id is kept), and its own entry for the turns after it."""
    parent, digest = _scan(
        memoryview(_pack(record.prompt_ids)), _pack(record.output_ids), index, lengths
    )
    if record.parent_id is None:
        record = dataclasses.replace(record, parent_id=parent)
    size = len(record.prompt_ids) + len(record.output_ids)
    return record, PrefixEntry(record.id, size, digest, record.created_at)


class ParentLinker:
    """Sets `parent_id` on completions before the gateway writes them.

    Keeps the prefix entries of the `max_sessions` most recently used sessions (LRU, a
    few dozen bytes per completion); a session not in it is loaded from the store once
    (one indexed query of four small columns). Every linked record is remembered at
    once, so the next turn finds it even before its write commits; if that write then
    fails, the child names a missing parent and `claims.py` drops the episode, which is
    the wanted outcome. With several gateway replicas, a session must stick to one
    replica (or use max_sessions=0: read the store every time), or a replica may link
    to an older turn, which only costs a branch in `build_sequences`, never bad tokens.
    Thread-safe."""

    def __init__(self, store: PrefixSource, *, max_sessions: int = 4096) -> None:
        if max_sessions < 0:
            raise ValueError(f"max_sessions ({max_sessions}) must be >= 0")
        self._store = store
        self._max_sessions = max_sessions
        self._entries: OrderedDict[str, PrefixIndex] = OrderedDict()
        self._lock = threading.Lock()

    def _cached(self, session_id: str, size: int = 0) -> tuple[PrefixIndex, list[int]] | None:
        """The session's index and its candidate lengths for a `size`-token prompt, or
        None when the session is not cached here."""
        with self._lock:
            index = self._entries.get(session_id)
            if index is None:
                return None
            self._entries.move_to_end(session_id)
            return index, index.candidates(size)

    def _index_of(self, session_id: str, size: int) -> tuple[PrefixIndex, list[int]]:
        cached = self._cached(session_id, size)
        if cached is not None:
            return cached
        loaded = PrefixIndex(self._store.prefix_entries(session_id))
        with self._lock:
            # A concurrent caller may have loaded (and extended) it meanwhile: keep theirs.
            index = self._entries.setdefault(session_id, loaded)
            while len(self._entries) > self._max_sessions:
                self._entries.popitem(last=False)
            return index, index.candidates(size)

    def find_parent(self, session_id: str, prompt_ids: Sequence[int]) -> str | None:
        """The parent of a prompt in `session_id` (see the module docstring)."""
        index, lengths = self._index_of(session_id, len(prompt_ids))
        return _scan(memoryview(_pack(prompt_ids)), b"", index, lengths)[0]

    def link_parent(self, record: CompletionRecord) -> CompletionRecord:
        """`record` with `parent_id` set by prefix matching (an explicit parent_id is
        kept), remembered as a parent candidate for the session's later turns. Records
        without a session are returned as is. Cost on a cache hit: CPU only, packing and
        one hash pass over prompt+output (~0.03 ms per 1k tokens); on a miss, plus one
        store query."""
        session_id = record.session_id
        if session_id is None:
            return record
        record, entry = _linked(record, *self._index_of(session_id, len(record.prompt_ids)))
        with self._lock:
            cached = self._entries.get(session_id)
            if cached is not None:
                cached.add(entry)
        return record

    def link_batch(self, records: list[CompletionRecord]) -> list[CompletionRecord]:
        """`link_parent` for a batch on the store writer's thread, for gateway processes
        that share the store (workers, replicas): the batch's sessions not cached here
        are read in one query right before its insert, so every earlier turn is seen
        whichever process wrote it (a turn's write committed before it was acknowledged,
        and the next turn was sent after that). Sessions cached here (`max_sessions` >
        0) link as `link_parent` does. Cost: one indexed query per batch, none per
        request on the event loop."""
        loaded = self._store.prefix_entries_of(
            {
                r.session_id
                for r in records
                if r.session_id is not None and self._cached(r.session_id) is None
            }
        )
        indexes = {session_id: PrefixIndex(entries) for session_id, entries in loaded.items()}
        out = []
        for record in records:
            index = indexes.get(record.session_id) if record.session_id is not None else None
            if index is None:  # no session, or cached here
                out.append(self.link_parent(record))
                continue
            record, entry = _linked(record, index, index.candidates(len(record.prompt_ids)))
            index.add(entry)
            out.append(record)
        return out

    async def alink_parent(self, record: CompletionRecord) -> CompletionRecord:
        """`link_parent` for an event loop: a cache miss reads the store in a thread."""
        if record.session_id is not None and self._cached(record.session_id) is None:
            return await asyncio.to_thread(self.link_parent, record)
        return self.link_parent(record)

    def track_new(self, session_id: str) -> None:
        """Start tracking a session this process just created: it has no completions, so
        its first turn needs no store query."""
        with self._lock:
            self._entries.setdefault(session_id, PrefixIndex())
            while len(self._entries) > self._max_sessions:
                self._entries.popitem(last=False)

    def forget(self, session_id: str) -> None:
        """Drop a session's entries (e.g. when it ends)."""
        with self._lock:
            self._entries.pop(session_id, None)
