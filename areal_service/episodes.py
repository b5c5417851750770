"""Episodes (read side): returns and training sequences of a session's completions.

Pure logic on `types.py` records; imports no store code (parent linking, the write side,
is `store/linking.py`'s). Never retokenizes: every training token is a token id the
gateway recorded. Claiming is `store/claims.py`'s, exporting `export.py`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from areal_service.types import CompletionRecord, RewardRecord, TrainSequence

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
    truncated = False
    for completion in chain:
        if completion.id in trained:
            continue  # shared with an earlier branch: context only, trained once
        trained.add(completion.id)
        ids.append(completion.id)
        truncated = completion.finish_reason == "length"  # the last one trained decides
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
        truncated=truncated,
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
