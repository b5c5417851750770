"""Data shaping for the console's session detail page: the turn tree (from `parent_id`),
each turn's new messages (tool calls, tool results and reasoning made readable), a
per-token view of every output coloured by logprob, the rewards, the discounted
returns, and the exact training sequences with their loss masks. Reads only; the
returns and sequences come from `areal_service.episodes`, as the trainer builds them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from areal_service.config import TrainerConfig
from areal_service.episodes import build_sequences, compute_returns
from areal_service.export import transcript
from areal_service.store import TrajectoryStore
from areal_service.types import CompletionRecord, RewardRecord, SessionRecord, TrainSequence
from gateway.tokenizer import ChatTokenizer

MAX_SEQUENCE_TOKENS = 4096
"""Tokens of one training sequence drawn on the page (the rest is counted, not drawn)."""

_TEXT_PARTS = ("text", "input_text", "output_text", "summary_text", "reasoning_text")


@dataclass(frozen=True, slots=True)
class TokenView:
    """One token as the page draws it: `p` = exp(logprob) drives the colour."""

    text: str
    token_id: int
    logprob: float | None
    version: int | None
    trained: bool = True
    """False for context tokens of a training sequence (loss mask 0)."""

    @property
    def p(self) -> float:
        return math.exp(self.logprob) if self.logprob is not None else 1.0

    @property
    def title(self) -> str:
        if not self.trained:
            return f"id {self.token_id} · context (loss mask 0)"
        lp = "n/a" if self.logprob is None else f"{self.logprob:.4f} (p {self.p:.3f})"
        return f"id {self.token_id} · logprob {lp} · version {self.version}"


@dataclass(frozen=True, slots=True)
class ToolCallView:
    """A tool call: the function name and its arguments, pretty-printed when JSON."""

    name: str
    arguments: str
    call_id: str = ""


@dataclass(frozen=True, slots=True)
class MessageView:
    """One conversation item, whatever API shape it came in."""

    role: str
    text: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallView, ...] = ()
    tool_call_id: str = ""


@dataclass(frozen=True, slots=True)
class TurnView:
    """One completion: its place in the tree, new messages, output tokens and return."""

    completion: CompletionRecord
    depth: int
    messages: tuple[MessageView, ...]
    earlier_messages: int
    """Messages of the request already shown on the parent turn (not repeated)."""
    tokens: tuple[TokenView, ...]
    reward: float
    """Sum of the rewards that land on this completion (session rewards: the last)."""
    turn_return: float | None


@dataclass(frozen=True, slots=True)
class SequenceView:
    """One training sequence, token by token, with its loss mask."""

    sequence: TrainSequence
    tokens: tuple[TokenView, ...]
    hidden_tokens: int
    trained_tokens: int


@dataclass(frozen=True, slots=True)
class SessionDetail:
    """Everything the session detail page shows."""

    session: SessionRecord
    turns: tuple[TurnView, ...]
    rewards: tuple[RewardRecord, ...]
    session_return: float | None
    sequences: tuple[SequenceView, ...]
    gamma: float


def _pretty(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            return json.dumps(json.loads(arguments), indent=2, ensure_ascii=False)
        except ValueError:
            return arguments
    return json.dumps(arguments, indent=2, ensure_ascii=False)


def _text(content: Any) -> str:
    """Plain text of a message content: a string, or a list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
                parts.append(str(part.get("text", "")))
            elif isinstance(part, dict):
                parts.append(f"[{part.get('type', 'part')}]")
            else:
                parts.append(str(part))
        return "\n".join(parts)
    return json.dumps(content, ensure_ascii=False)


def message_view(item: Any) -> MessageView:
    """A Chat Completions message or a Responses item, made readable."""
    if not isinstance(item, dict):
        return MessageView(role="?", text=json.dumps(item, ensure_ascii=False))
    kind = item.get("type")
    if kind == "function_call":
        call = ToolCallView(
            item.get("name", ""), _pretty(item.get("arguments", "")), item.get("call_id", "")
        )
        return MessageView(role="assistant", tool_calls=(call,))
    if kind == "function_call_output":
        return MessageView(
            role="tool", text=_text(item.get("output")), tool_call_id=item.get("call_id", "")
        )
    if kind == "reasoning":
        return MessageView(
            role="assistant", reasoning=_text(item.get("summary") or item.get("content"))
        )
    calls = tuple(
        ToolCallView(
            c.get("function", {}).get("name", ""),
            _pretty(c.get("function", {}).get("arguments", "")),
            c.get("id", ""),
        )
        for c in item.get("tool_calls") or []
        if isinstance(c, dict)
    )
    reasoning = item.get("reasoning_content") or item.get("reasoning") or ""
    return MessageView(
        role=str(item.get("role", kind or "?")),
        text=_text(item.get("content")),
        reasoning=_text(reasoning),
        tool_calls=calls,
        tool_call_id=item.get("tool_call_id", ""),
    )


def _display(tokenizer: ChatTokenizer, token_id: int) -> str:
    """A token's text with whitespace made visible (newline as ↵ plus a real break)."""
    text = tokenizer.token_info(token_id)[0]
    return text.replace("\t", "→\t").replace("\n", "↵\n")


def token_views(
    tokenizer: ChatTokenizer,
    ids: Sequence[int],
    logprobs: Sequence[float],
    versions: Sequence[int],
    mask: Sequence[int] | None = None,
) -> tuple[TokenView, ...]:
    """Tokens with their logprob and version; `mask` 0 marks context (no logprob)."""
    return tuple(
        TokenView(
            _display(tokenizer, tid),
            tid,
            logprobs[i] if i < len(logprobs) else None,
            versions[i] if i < len(versions) else None,
            trained=mask is None or bool(mask[i]),
        )
        for i, tid in enumerate(ids)
    )


def _tree_order(completions: list[CompletionRecord]) -> list[tuple[CompletionRecord, int]]:
    """Depth-first over the `parent_id` tree, children oldest first; a completion whose
    parent is not in the session is a root."""
    ids = {c.id for c in completions}
    children: dict[str | None, list[CompletionRecord]] = {}
    for c in completions:
        children.setdefault(c.parent_id if c.parent_id in ids else None, []).append(c)
    out: list[tuple[CompletionRecord, int]] = []
    stack = [(c, 0) for c in reversed(children.get(None, []))]
    while stack:
        node, depth = stack.pop()
        out.append((node, depth))
        stack.extend((c, depth + 1) for c in reversed(children.get(node.id, [])))
    return out


def _turn_rewards(
    completions: list[CompletionRecord], rewards: list[RewardRecord], session: SessionRecord
) -> dict[str, float]:
    """Per-completion reward sums (the targeting rule of `episodes.compute_returns`)."""
    ids = {c.id for c in completions}
    last = completions[-1].id if completions else ""
    sums = dict.fromkeys(ids, 0.0)
    for r in rewards:
        if r.completion_id in ids:
            sums[r.completion_id] += r.value
        elif (
            r.completion_id is None
            and last
            and (
                r.session_id == session.id
                or (r.session_id is None and r.group_id == session.group_id)
            )
        ):
            sums[last] += r.value
    return sums


def session_detail(
    store: TrajectoryStore, trainer: TrainerConfig, tokenizer: ChatTokenizer, session_id: str
) -> SessionDetail | None:
    """The detail of one session, or None when it does not exist."""
    session = store.get_session(session_id)
    if session is None:
        return None
    completions = store.list_completions(session_id)
    groups = [session.group_id] if session.group_id else []
    rewards = [
        r for r in store.load_rewards([session_id], groups) if r.session_id in (None, session_id)
    ]
    returns = compute_returns(
        completions,
        rewards,
        group_id=session.group_id,
        gamma=trainer.turn_discount,
        default_reward=trainer.unrewarded_return(),
    )
    per_turn = _turn_rewards(completions, rewards, session)
    by_id = {c.id: c for c in completions}
    shown: dict[str, int] = {}
    turns = []
    for completion, depth in _tree_order(completions):
        items = transcript(completion)
        parent = by_id.get(completion.parent_id or "")
        # The request repeats the parent's transcript; show only what is new.
        earlier = min(shown.get(parent.id, 0), max(len(items) - 1, 0)) if parent else 0
        shown[completion.id] = len(items)
        turns.append(
            TurnView(
                completion,
                depth,
                tuple(message_view(m) for m in items[earlier:]),
                earlier,
                token_views(
                    tokenizer,
                    completion.output_ids,
                    completion.output_logprobs,
                    completion.output_versions,
                ),
                per_turn.get(completion.id, 0.0),
                (returns or {}).get(completion.id),
            )
        )
    sequences = (
        build_sequences(
            completions, returns or dict.fromkeys(by_id, 0.0), group_id=session.group_id
        )
        if completions
        else []
    )
    first = min(completions, key=lambda c: (c.created_at, c.id)) if completions else None
    return SessionDetail(
        session,
        tuple(turns),
        tuple(rewards),
        returns[first.id] if returns and first else None,
        tuple(_sequence_view(tokenizer, s) for s in sequences),
        trainer.turn_discount,
    )


def _sequence_view(tokenizer: ChatTokenizer, sequence: TrainSequence) -> SequenceView:
    n = min(len(sequence.input_ids), MAX_SEQUENCE_TOKENS)
    tokens = token_views(
        tokenizer,
        sequence.input_ids[:n],
        sequence.logprobs[:n],
        sequence.versions[:n],
        sequence.loss_mask[:n],
    )
    return SequenceView(sequence, tokens, len(sequence.input_ids) - n, sum(sequence.loss_mask))
