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


def _scan(
    packed_prompt: memoryview, packed_output: bytes, entries: Iterable[PrefixEntry]
) -> tuple[str | None, str]:
    """(parent id, digest of prompt+output) in ONE blake2b pass: the hash state is
    copied at each candidate length, so the cost is O(prompt + output + k log k) for k
    candidates, however many earlier turns there are; empty entries never match."""
    size = len(packed_prompt) // 4
    candidates = sorted(
        (e for e in entries if 0 < e.length <= size), key=lambda e: (e.length, e.created_at)
    )
    hasher = hashlib.blake2b(digest_size=DIGEST_SIZE)
    fed = 0
    best: str | None = None
    for entry in candidates:
        _feed(hasher, packed_prompt[4 * fed : 4 * entry.length])
        fed = entry.length
        if hasher.copy().hexdigest() == entry.digest:
            best = entry.completion_id  # later candidates are longer or newer
    _feed(hasher, packed_prompt[4 * fed :])
    _feed(hasher, packed_output)
    return best, hasher.hexdigest()


def match_parent(prompt_ids: Sequence[int], entries: Iterable[PrefixEntry]) -> str | None:
    """The id of the longest entry (newest on ties) whose prompt+output is a prefix of
    `prompt_ids`, or None."""
    return _scan(memoryview(_pack(prompt_ids)), b"", entries)[0]


class PrefixSource(Protocol):
    """Where a linker loads a session's prefix entries on a cache miss (the store's
    `TrajectoryStore.prefix_entries`; a protocol so this module needs no store import)."""

    def prefix_entries(self, session_id: str) -> list[PrefixEntry]: ...

    def prefix_entries_of(self, session_ids: Collection[str]) -> dict[str, list[PrefixEntry]]:
        ...


def _linked(record: CompletionRecord, entries: Iterable[PrefixEntry]
            ) -> tuple[CompletionRecord, PrefixEntry]:
    """`record` with its parent among `entries` (an explicit parent_id is kept), and its
    own entry for the turns after it."""
    parent, digest = _scan(memoryview(_pack(record.prompt_ids)), _pack(record.output_ids),
                           entries)
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
        self._entries: OrderedDict[str, dict[str, PrefixEntry]] = OrderedDict()
        self._lock = threading.Lock()

    def _cached(self, session_id: str) -> list[PrefixEntry] | None:
        with self._lock:
            entries = self._entries.get(session_id)
            if entries is None:
                return None
            self._entries.move_to_end(session_id)
            return list(entries.values())

    def _entries_of(self, session_id: str) -> list[PrefixEntry]:
        cached = self._cached(session_id)
        if cached is not None:
            return cached
        loaded = {e.completion_id: e for e in self._store.prefix_entries(session_id)}
        with self._lock:
            # A concurrent caller may have loaded (and extended) it meanwhile: keep theirs.
            entries = self._entries.setdefault(session_id, loaded)
            while len(self._entries) > self._max_sessions:
                self._entries.popitem(last=False)
            return list(entries.values())

    def find_parent(self, session_id: str, prompt_ids: Sequence[int]) -> str | None:
        """The parent of a prompt in `session_id` (see the module docstring)."""
        return match_parent(prompt_ids, self._entries_of(session_id))

    def link_parent(self, record: CompletionRecord) -> CompletionRecord:
        """`record` with `parent_id` set by prefix matching (an explicit parent_id is
        kept), remembered as a parent candidate for the session's later turns. Records
        without a session are returned as is. Cost on a cache hit: CPU only, packing and
        one hash pass over prompt+output (~0.03 ms per 1k tokens); on a miss, plus one
        store query."""
        if record.session_id is None:
            return record
        record, entry = _linked(record, self._entries_of(record.session_id))
        with self._lock:
            cached = self._entries.get(record.session_id)
            if cached is not None:
                cached.setdefault(record.id, entry)
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
            {r.session_id for r in records
             if r.session_id is not None and self._cached(r.session_id) is None})
        out = []
        for record in records:
            entries = loaded.get(record.session_id) if record.session_id is not None else None
            if entries is None:  # no session, or cached here
                out.append(self.link_parent(record))
                continue
            record, entry = _linked(record, entries)
            entries.append(entry)
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
            self._entries.setdefault(session_id, {})
            while len(self._entries) > self._max_sessions:
                self._entries.popitem(last=False)

    def forget(self, session_id: str) -> None:
        """Drop a session's entries (e.g. when it ends)."""
        with self._lock:
            self._entries.pop(session_id, None)
