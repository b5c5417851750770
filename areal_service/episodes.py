"""Episodes: parent linking of completions, returns, and training sequences.

Pure logic on `types.py` records, except `ParentLinker`, which reads prefix entries
through the store (imported for typing only). Never retokenizes: every training token is
a token id the gateway recorded. Claiming is `claims.py`'s, exporting `export.py`'s.

Parent rule: a completion's parent is the earlier completion of its session whose
prompt_ids + output_ids is the longest exact prefix of its prompt_ids (newest on ties).
Compared by blake2b-128 of packed int32 bytes, never element by element.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal_service.types import CompletionRecord, RewardRecord, TrainSequence

if TYPE_CHECKING:
    from areal_service.store import TrajectoryStore

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

    def __init__(self, store: TrajectoryStore, *, max_sessions: int = 4096) -> None:
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
        entries = self._entries_of(record.session_id)
        parent, digest = _scan(
            memoryview(_pack(record.prompt_ids)), _pack(record.output_ids), entries
        )
        if record.parent_id is None:
            record = dataclasses.replace(record, parent_id=parent)
        size = len(record.prompt_ids) + len(record.output_ids)
        entry = PrefixEntry(record.id, size, digest, record.created_at)
        with self._lock:
            cached = self._entries.get(record.session_id)
            if cached is not None:
                cached.setdefault(record.id, entry)
        return record

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


# Returns.


def _session_rewards(
    completions: Sequence[CompletionRecord], rewards: Iterable[RewardRecord], group_id: str | None
) -> tuple[dict[str, float], bool]:
    """Per-completion reward sums and whether any reward targets this session. Target
    precedence: completion_id, then session_id, then group_id; session and group rewards
    count as the reward of the session's LAST completion. Several named rewards on the
    same target add up (a judge's `correct` plus a `format` bonus is one scalar)."""
    ids = {c.id for c in completions}
    session_id = completions[-1].session_id
    last = completions[-1].id
    sums = {c.id: 0.0 for c in completions}
    found = False
    for reward in rewards:
        if reward.completion_id is not None:
            target = reward.completion_id if reward.completion_id in ids else None
        elif reward.session_id is not None:
            target = last if reward.session_id == session_id else None
        else:
            target = last if group_id is not None and reward.group_id == group_id else None
        if target is not None:
            sums[target] += reward.value
            found = True
    return sums, found


def compute_returns(
    completions: Sequence[CompletionRecord],
    rewards: Iterable[RewardRecord],
    *,
    group_id: str | None = None,
    gamma: float = 1.0,
    default_reward: float | None = 0.0,
) -> dict[str, float] | None:
    """Discounted returns of one session's completions, in created_at order:
    R_i = r_i + γ·R_{i+1}, R_last = r_last. `rewards` may hold rows of other sessions
    (ignored). A session that no reward targets gets r_last = `default_reward`, or
    None (drop it) when `default_reward` is None. Empty sessions give {}."""
    if not completions:
        return {}
    completions = sorted(completions, key=lambda c: (c.created_at, c.id))
    sums, found = _session_rewards(completions, rewards, group_id)
    if not found:
        if default_reward is None:
            return None
        sums[completions[-1].id] = default_reward
    returns: dict[str, float] = {}
    running = 0.0
    for completion in reversed(completions):
        running = sums[completion.id] + gamma * running
        returns[completion.id] = running
    return returns


# Training sequences.


def _extends(parent: CompletionRecord, child: CompletionRecord) -> bool:
    """Whether child's prompt starts with parent's prompt+output, at one temperature
    (a sequence is scored at one temperature, see TrainSequence.temperature)."""
    n, m = len(parent.prompt_ids), len(parent.output_ids)
    return (
        n + m <= len(child.prompt_ids)
        and parent.temperature == child.temperature
        and child.prompt_ids[:n] == parent.prompt_ids
        and child.prompt_ids[n : n + m] == parent.output_ids
    )


def _chain(leaf: CompletionRecord, by_id: Mapping[str, CompletionRecord]) -> list[CompletionRecord]:
    """Root-first chain ending at `leaf`, cut at the first link that is not an exact
    prefix (or names a parent outside the session)."""
    chain = [leaf]
    while True:
        parent = by_id.get(chain[-1].parent_id or "")
        if parent is None or not _extends(parent, chain[-1]):
            return chain[::-1]
        chain.append(parent)


def _merge(
    chain: Sequence[CompletionRecord],
    trained: set[str],
    returns: Mapping[str, float],
    group_id: str | None,
) -> TrainSequence:
    """One sequence from a root-first chain: leaf prompt+output, mask 1 on the output
    tokens of completions not yet in `trained` (which it then extends)."""
    leaf = chain[-1]
    input_ids = leaf.prompt_ids + leaf.output_ids
    size = len(input_ids)
    loss_mask, logprobs, versions = [0] * size, [0.0] * size, [-1] * size
    ids: list[str] = []
    for completion in chain:
        if completion.id in trained:
            continue  # shared with an earlier branch: context only, trained once
        trained.add(completion.id)
        ids.append(completion.id)
        start = len(completion.prompt_ids)
        end = start + len(completion.output_ids)
        loss_mask[start:end] = [1] * (end - start)
        logprobs[start:end] = completion.output_logprobs
        versions[start:end] = completion.output_versions
    return TrainSequence(
        session_id=leaf.session_id or "",
        group_id=group_id,
        completion_ids=tuple(ids),
        input_ids=input_ids,
        loss_mask=tuple(loss_mask),
        logprobs=tuple(logprobs),
        versions=tuple(versions),
        reward=returns[ids[0]],
        temperature=leaf.temperature,
    )


def build_sequences(
    completions: Sequence[CompletionRecord],
    returns: Mapping[str, float],
    *,
    group_id: str | None = None,
) -> list[TrainSequence]:
    """Training sequences of one session, without retokenization.

    Parent links (`parent_id`) are followed, and re-verified: a link whose parent's
    prompt+output is not an exact prefix of the child's prompt (or whose temperature
    differs) starts a new sequence. Each leaf of the turn tree ends one sequence: its
    prompt+output, with loss_mask 1 / behaviour logprob / version on generated tokens and
    0 / 0.0 / -1 everywhere else (first prompt, tool results, user turns, template glue).
    Branches: the shared prefix is repeated as context in each branch but trained
    (mask 1) only in the first branch (oldest leaf), so every generated token counts
    once; `completion_ids` lists the completions a sequence trains, and `reward` is the
    return of the first of them. Order: by leaf, oldest first. `returns` must hold
    every completion id (see `compute_returns`).
    """
    ordered = sorted(completions, key=lambda c: (c.created_at, c.id))
    by_id = {c.id: c for c in ordered}
    # A completion whose children all break the prefix is a leaf as well.
    extended = {
        parent.id
        for c in ordered
        if (parent := by_id.get(c.parent_id or "")) is not None and _extends(parent, c)
    }
    trained: set[str] = set()
    return [
        _merge(_chain(leaf, by_id), trained, returns, group_id)
        for leaf in ordered
        if leaf.id not in extended
    ]


def missing_part(completions: Sequence[CompletionRecord]) -> str | None:
    """Why an episode must not be trained, or None: no completions, or a completion
    names a parent that is not in the session (its capture failed)."""
    if not completions:
        return "no completions"
    ids = {c.id for c in completions}
    for completion in completions:
        if completion.parent_id is not None and completion.parent_id not in ids:
            return f"missing parent {completion.parent_id} of {completion.id}"
    return None


@dataclass(frozen=True, slots=True)
class SessionEpisode:
    """One session made ready for training or export."""

    session_id: str
    sequences: tuple[TrainSequence, ...]
    session_return: float | None
    """Return of the session's first completion; None when no reward targets the session
    and `default_reward` is None (its sequences then carry reward 0.0)."""
    problem: str | None
    """Why it must never be trained (`missing_part`), else None."""


def build_episode(
    session_id: str,
    completions: Sequence[CompletionRecord],
    rewards: Iterable[RewardRecord],
    *,
    group_id: str | None = None,
    gamma: float = 1.0,
    default_reward: float | None = 0.0,
) -> SessionEpisode:
    """Returns, then sequences, of one session (`compute_returns`, `build_sequences`)."""
    returns = compute_returns(
        completions, rewards, group_id=group_id, gamma=gamma, default_reward=default_reward
    )
    first = min(completions, key=lambda c: (c.created_at, c.id), default=None)
    session_return = None if returns is None or first is None else returns[first.id]
    sequences = build_sequences(
        completions, returns or dict.fromkeys((c.id for c in completions), 0.0), group_id=group_id
    )
    return SessionEpisode(session_id, tuple(sequences), session_return, missing_part(completions))
