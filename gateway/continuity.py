"""Token continuity across turns: a turn that extends an earlier completion of its session
is prompted with that completion's exact ids, not a re-tokenization of its text.

Why: re-rendering a conversation re-tokenizes the model's own sampled text, and BPE does
not give back the sampled ids (it picks one canonical split; the model may have sampled
another). The next prompt then no longer starts with the previous prompt + output, the
parent link fails, and a T-turn agent exports T training sequences (O(T²) tokens) whose
contexts the policy never generated from.

Rule: when a request's messages (normalized) are an earlier completion's prompt messages,
plus the assistant message the gateway returned for it (as the chat API or the Responses
API replays it: `assistant_key`), plus new messages, with the same tools, its prompt is

    earlier prompt ids + earlier output ids + ids(glue + suffix)

where `suffix` is the chat template's text of the new messages (+ generation prompt):
the full rendering minus the rendering of the conversation up to the assistant message,
and `glue` is what the template puts after that message's end-of-turn token (e.g. "\\n"),
preceded by the end-of-turn token itself when the output stopped without it (max_tokens,
a stop string, another EOS). Tokenizing `glue + suffix` alone equals tokenizing it in
place because it starts right after an added token, where tokenizers split.

Checks (else a full render, counted in `areal_token_continuity_total`): the earlier
prompt's template text is a prefix of the rendering up to the assistant message, which
is a prefix of the full rendering (templates that rewrite history, e.g. drop earlier
reasoning, fail this), and the assistant's rendered turn contains an added token to end
on.

Cost per turn: one Jinja render of the conversation (O(context) text) plus a render of
the assistant turn alone, and a tokenization of only the new text; no BPE over the
history. Memory: a bounded LRU of the last completions of recent sessions.

Across processes: each recorded completion carries a `continuity_key` (how many
messages its prompt had, a digest of their template text and tools, a digest of the
reply it gave). A turn whose conversation holds an assistant message this process did
not serve (the previous turn went to another gateway worker or replica, or came before
a restart or an eviction) reads the session's newest keyed completions from the store
(`recall`: one indexed query, off the event loop) and continues the newest one whose
messages and reply it extends, checked by rendering those messages once. Nothing of
the conversation is stored twice: the request JSON already holds it, the key holds
~80 bytes. A turn the store cannot place still gets a full render (counted as
`no_match`), which only loses the optimisation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from prometheus_client import Counter

from areal_service.types import RecentTurn
from gateway.protocol import ToolChoice
from gateway.tokenizer import ChatTokenizer
from gateway.translate import (
    ParsedChoice,
    checked_text,
    normalize_messages,
    render_prompt_ids,
    tools_enabled,
)

log = logging.getLogger(__name__)

Outcome = Literal["continued", "no_match", "prefix_changed", "not_prefix_stable", "no_end_of_turn"]
"""How a turn's prompt was built: `continued` (from an earlier completion's ids);
`no_match` (a full render: no cached completion is extended, e.g. a first turn, edited
history, a gateway restart); the rest are fallbacks to a full render where a completion
matched but the template is not prefix-stable for it."""

MAX_ENTRIES_PER_SESSION = 8
"""Completions (choices) remembered per session, newest first: covers `n` > 1 and a
client that retries or branches from one of the last few turns."""
_BYTES_PER_ID = 40
"""A cached id in a Python list: an 8-byte pointer and (above 256) a 28-byte int."""


class HasOutputIds(Protocol):
    """A finished generation (`backend.Generation`)."""

    @property
    def output_ids(self) -> Sequence[int]: ...


AssistantKey = tuple[str, str, tuple[tuple[str | None, str, str], ...]]


def assistant_key(message: Mapping[str, Any]) -> AssistantKey:
    """What identifies a normalized assistant message: content (None and "" alike: the
    chat API returns None beside tool calls, Responses replays ""), reasoning, and each
    tool call's (id, name, arguments string)."""
    calls = tuple(
        (c.get("id"), c["function"]["name"], c["function"].get("arguments", "{}"))
        for c in message.get("tool_calls") or ()
    )
    return (message.get("content") or "", message.get("reasoning_content") or "", calls)


RecentTurns = Callable[[str, int], Sequence[RecentTurn]]
"""(session id, n) -> the session's newest n keyed completions, newest first (the store's
`recent_turns`)."""


def _digest(*parts: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def _tools_text(tools: list[dict[str, Any]] | None) -> str:
    return "" if not tools else json.dumps(tools, sort_keys=True, separators=(",", ":"))


def _reply_digest(assistant: AssistantKey) -> str:
    return _digest(json.dumps(assistant, separators=(",", ":")))


def _parse_key(key: str) -> tuple[int, str, str] | None:
    count, _, rest = key.partition(":")
    prompt, _, reply = rest.partition(":")
    return (int(count), prompt, reply) if count.isdigit() and prompt and reply else None


@dataclass(frozen=True, slots=True)
class Lineage:
    """What a turn's prompt was made from; with its outputs, what the next turn of its
    session may continue from (`Continuity.remember`)."""

    session_id: str
    messages: list[dict[str, Any]]
    """The request's messages, normalized (`translate.normalize_messages`)."""
    tools: list[dict[str, Any]] | None
    """The tools as rendered (None when not rendered)."""
    text: str
    """The template's text of `messages` with the generation prompt. Under continuity the
    prompt ids are not its tokenization (earlier outputs are the sampled ids); the text is
    what the next turn checks template stability against."""
    prompt_ids: list[int]
    """The turn's prompt ids (the list the turn sends; never mutated)."""
    outcome: Outcome
    digest: str | None = None
    """Digest of `text` and `tools`, the prompt part of the records' `continuity_key`
    (None when nothing records keys). Made where `text` is: on the large-prompt worker
    for a large prompt, never O(context) work on the event loop at record time."""


@dataclass(frozen=True, slots=True)
class _Entry:
    lineage: Lineage
    output_ids: Sequence[int]
    assistant: AssistantKey

    @property
    def weight(self) -> int:
        """Approximate bytes held: ids as Python lists (a pointer and an int object,
        shared with the turn's own lists; kept as lists because converting a 64k-token
        prompt to and from a compact array cost more than the rest of a continued turn),
        text and messages about a byte a character."""
        return _BYTES_PER_ID * (len(self.lineage.prompt_ids) + len(self.output_ids)) + 2 * len(
            self.lineage.text
        )


class ContinuityCache:
    """The last completions of recent sessions, LRU by session, bounded in bytes.
    Thread-safe (the pipeline runs on the event loop; tests may call from threads)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._sessions: OrderedDict[str, list[_Entry]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def bytes(self) -> int:
        return self._bytes

    def entries(self, session_id: str) -> list[_Entry]:
        """The session's remembered completions, newest first (marks it recently used)."""
        with self._lock:
            entries = self._sessions.get(session_id)
            if entries is None:
                return []
            self._sessions.move_to_end(session_id)
            return list(entries)

    def add(self, session_id: str, new: Sequence[_Entry]) -> None:
        """Remember `new` as the session's newest completions; evict the least recently
        used sessions beyond the budget (an entry larger than the budget is not kept)."""
        with self._lock:
            entries = self._sessions.pop(session_id, [])
            kept = [*new, *entries][:MAX_ENTRIES_PER_SESSION]
            # Only what came in and what fell off change the total (not every kept one).
            dropped = entries[max(0, MAX_ENTRIES_PER_SESSION - len(new)) :]
            self._bytes += sum(e.weight for e in kept[: len(new)]) - sum(e.weight for e in dropped)
            self._sessions[session_id] = kept
            while self._bytes > self.max_bytes and self._sessions:
                _, dropped = self._sessions.popitem(last=False)
                self._bytes -= sum(e.weight for e in dropped)

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._bytes -= sum(e.weight for e in self._sessions.pop(session_id, []))


def find_extended(
    entries: Sequence[_Entry],
    messages: Sequence[Mapping[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> _Entry | None:
    """The newest entry whose prompt messages + assistant message start `messages`, with
    new messages after them, under the same tools. List/dict equality runs in C."""
    for entry in entries:
        prior = entry.lineage.messages
        k = len(prior)
        if (
            len(messages) > k + 1
            and entry.lineage.tools == tools
            and messages[k]["role"] == "assistant"
            and assistant_key(messages[k]) == entry.assistant
            and messages[:k] == prior
        ):
            return entry
    return None


class EndOfTurn:
    """The tokenizer's added tokens (`<|im_end|>`, `<tool_call>`, ...): the template's
    end-of-turn token of an assistant turn is the last added token in its rendering."""

    def __init__(self, added_tokens: Mapping[int, str]) -> None:
        by_text = {text: i for i, text in added_tokens.items() if text}
        self._ids = by_text
        alternatives = sorted(by_text, key=len, reverse=True)  # longest match first
        self._pattern = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None

    def split(self, turn_text: str) -> tuple[str, int, str] | None:
        """(marker text, its id, the text after it) of the last added token in
        `turn_text`, or None when it has none."""
        if self._pattern is None:
            return None
        last = None
        for last in self._pattern.finditer(turn_text):  # noqa: B007 - the last match
            pass
        if last is None:
            return None
        return last.group(), self._ids[last.group()], turn_text[last.end() :]


def continued_prompt(
    tokenizer: ChatTokenizer,
    end_of_turn: EndOfTurn,
    entry: _Entry,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    full: str,
) -> list[int] | Outcome:
    """Prompt ids of `messages`, which extend `entry` (see `find_extended`) and whose
    template text is `full` (rendered once by the caller, which a fallback reuses), or the
    fallback outcome when the template is not prefix-stable.

    `full` is the one O(context) render; the assistant turn's text comes from
    a render of just it and the message before it, accepted only where the full text
    holds exactly that text right after the earlier prompt's text. Else (a template whose
    turns depend on their position) the conversation up to the assistant message is
    rendered too: a second O(context) render, which was ~70% of a continued turn's
    prompt cost at 64k tokens."""
    prior = entry.lineage
    if not full.startswith(prior.text):
        return "prefix_changed"
    k = len(prior.messages) + 1
    turn = _turn_text_alone(tokenizer, messages[k - 2 : k], tools)
    if turn is None or not full.startswith(turn, len(prior.text)):
        head = tokenizer.render(messages[:k], tools, add_generation_prompt=False)
        if not head.startswith(prior.text):
            return "prefix_changed"
        if not full.startswith(head):
            return "not_prefix_stable"
        turn = head[len(prior.text) :]
    split = end_of_turn.split(turn)
    if split is None:
        return "no_end_of_turn"
    marker, marker_id, tail = split
    out = entry.output_ids
    glue = tail if out and out[-1] == marker_id else marker + tail
    new_ids = tokenizer.encode(checked_text(glue + full[len(prior.text) + len(turn) :]))
    return [*prior.prompt_ids, *out, *new_ids]


def _turn_text_alone(
    tokenizer: ChatTokenizer, pair: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> str | None:
    """The template's text of the assistant message `pair[1]` after `pair[0]` (the
    message it answered), rendered without the rest of the conversation; None where the
    template does not render that pair as a prefix extension (or refuses it)."""
    try:
        before = tokenizer.render(pair[:1], tools)
        both = tokenizer.render(pair, tools, add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template may refuse a partial conversation
        return None
    return both[len(before) :] if both.startswith(before) else None


class Continuity:
    """Builds each turn's prompt ids (continuing an earlier completion where it can) and
    remembers completions for the turns after them. One per gateway app."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        enabled: bool,
        max_bytes: int,
        counter: Counter | None = None,
        recent: RecentTurns | None = None,
        recalls: Counter | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.enabled = enabled
        self.cache = ContinuityCache(max_bytes)
        self._end_of_turn = EndOfTurn(tokenizer.core.added_tokens)
        self._counter = counter
        self._outcomes: dict[str, Any] = {}
        """`counter`'s labelled children, made once (`labels()` costs ~1.5 µs a call)."""
        self._recent = recent
        """The store's keyed completions (None: nothing is recorded, no recall)."""
        self._recalls = recalls

    def wants_recall(self, session_id: str | None, messages: Sequence[Mapping[str, Any]]) -> bool:
        """Whether this turn should `recall` from the store first: its conversation holds
        an assistant message past everything this process remembers of the session.
        O(messages) without a render; on the event loop."""
        if self._recent is None or not self.enabled or session_id is None:
            return False
        last = next(
            (i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "assistant"),
            -1,
        )
        if last < 0:
            return False
        entries = self.cache.entries(session_id)
        return not entries or last > len(entries[0].lineage.messages)

    def recall(
        self,
        session_id: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: ToolChoice | None,
    ) -> bool:
        """Remember the newest recorded completion of the session that `messages` extend
        (its prompt messages and tools, then its very reply, then more), read from the
        store; True if one was found. Blocking (a query and a render): run it off the
        event loop. `prompt` then continues it like any remembered completion."""
        assert self._recent is not None
        entries = self.cache.entries(session_id)
        known = len(entries[0].lineage.messages) if entries else -1
        found = False
        normalized: list[dict[str, Any]] | None = None
        rendered_tools: list[dict[str, Any]] | None = None
        for turn in self._recent(session_id, MAX_ENTRIES_PER_SESSION):
            parsed = _parse_key(turn.continuity_key)
            if parsed is None:
                continue
            k, prompt_digest, reply_digest = parsed
            if k <= known:
                break  # newest first: nothing newer than what this process remembers
            if normalized is None:
                normalized = normalize_messages(messages)
                rendered_tools = _rendered(tools, tool_choice)
            if len(normalized) <= k + 1 or normalized[k]["role"] != "assistant":
                continue
            assistant = assistant_key(normalized[k])
            if _reply_digest(assistant) != reply_digest:
                continue
            prior = normalized[:k]
            try:
                text = self.tokenizer.render(prior, rendered_tools)
            except Exception:  # noqa: BLE001 - the full render in `prompt` reports it
                break
            if _digest(text, _tools_text(rendered_tools)) != prompt_digest:
                continue
            lineage = Lineage(
                session_id,
                prior,
                rendered_tools,
                text,
                turn.prompt_ids(),
                "continued",
                prompt_digest,
            )
            self.cache.add(session_id, [_Entry(lineage, turn.output_ids(), assistant)])
            found = True
            break
        if self._recalls is not None:
            self._recalls.labels("found" if found else "none").inc()
        return found

    def keys(self, lineage: Lineage | None, choices: Sequence[ParsedChoice]) -> list[str | None]:
        """Each choice's `continuity_key` for its record (None without a lineage, or when
        nothing is recorded):
        `<prompt messages>:<digest of their template text and tools>:<digest of the
        reply>`, what `recall` checks a later turn against."""
        if lineage is None or lineage.digest is None:  # nothing records or reads them
            return [None] * len(choices)
        head = f"{len(lineage.messages)}:{lineage.digest}"
        return [f"{head}:{_reply_digest(_assistant_of(choice))}" for choice in choices]

    def prompt(
        self,
        session_id: str | None,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: ToolChoice | None,
    ) -> tuple[list[int], Lineage | None]:
        """Prompt ids of a chat request (as `translate.render_prompt_ids` renders them,
        or continued), and its lineage to remember (None without a session or when off).
        Raises `InvalidRequestError` for text the tokenizer cannot take."""
        if not self.enabled or session_id is None:
            return render_prompt_ids(self.tokenizer, messages, tools, tool_choice), None
        rendered_tools = _rendered(tools, tool_choice)
        normalized = normalize_messages(messages)
        outcome: Outcome = "no_match"
        full = self.tokenizer.render(normalized, rendered_tools)
        entry = find_extended(self.cache.entries(session_id), normalized, rendered_tools)
        if entry is not None:
            result = continued_prompt(
                self.tokenizer, self._end_of_turn, entry, normalized, rendered_tools, full
            )
            if isinstance(result, list):
                return result, self._lineage(
                    session_id, normalized, rendered_tools, full, result, "continued"
                )
            outcome = result
            log.debug("session %s: token continuity falls back (%s)", session_id, outcome)
        text = checked_text(full)  # the fallback reuses the render
        ids = self.tokenizer.encode(text)
        return ids, self._lineage(session_id, normalized, rendered_tools, text, ids, outcome)

    def _lineage(
        self,
        session_id: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        text: str,
        ids: list[int],
        outcome: Outcome,
    ) -> Lineage:
        if self._counter is not None:
            child = self._outcomes.get(outcome)
            if child is None:
                child = self._outcomes[outcome] = self._counter.labels(outcome)
            child.inc()
        digest = None if self._recent is None else _digest(text, _tools_text(tools))
        return Lineage(session_id, messages, tools, text, ids, outcome, digest)

    def remember(
        self,
        lineage: Lineage | None,
        generations: Sequence[HasOutputIds],
        choices: Sequence[ParsedChoice],
    ) -> None:
        """After a turn is recorded: its choices become what later turns may extend
        (`generations[i].output_ids`: choice i's generated ids, as recorded)."""
        if lineage is None:
            return
        entries = [
            _Entry(lineage, gen.output_ids, _assistant_of(choice))
            for gen, choice in zip(generations, choices, strict=True)
        ]
        self.cache.add(lineage.session_id, entries)


def _rendered(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: ToolChoice | None
) -> list[dict[str, Any]] | None:
    """The tools as the template renders them (None when not rendered)."""
    return [dict(t) for t in tools or ()] if tools_enabled(tools, tool_choice) else None


def _assistant_of(choice: ParsedChoice) -> AssistantKey:
    """The key of the assistant message a client replays for `choice`."""
    return assistant_key(normalize_messages([choice.to_message()])[0])
