"""The neutral block-event stream: one choice's deltas (`ChoiceStream`) as an ordered
run of blocks, each opened, fed and closed, for the wires that stream blocks
(Responses output items, Anthropic content blocks). The chat wire has no blocks: its
chunks carry each delta as it comes (`gateway.wires.chat.encode`).

A block is reasoning text, reply text, or a tool call. The ordering rules live here and
only here; an encoder subclasses `BlockStream` and says how each step is named and
shaped on its wire (`on_*` hooks), never when it happens:

- at most one block is open; a new kind of text closes the open block first;
- a step's events follow the text: the open call's argument text (and its close, if
  the call completed), then reply text (before any new call), then each new call
  (which closes the block before it), its arguments as they arrive;
- `ChoiceStream` sends a call's arguments after its head only, so argument text for
  anything but the open call is dropped;
- a call closes `completed` (the parse found it whole), `superseded` (the next call
  began: formats start one only after the last one's arguments ended; Mistral's
  calls complete only when the reply does), or neither (text or the end came instead:
  its text is the reply's content);
- at the end the open block closes, then an empty text block opens and closes if the
  wire owes one (`owes_text`: its whole reply has a text block no step opened),
  then `on_finish`.

Cost per token: the common step (text into the open block of the same kind) is one
comparison and one hook call; no event object is made here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from gateway.tokenizer import ChatTokenizer
from gateway.toolparse import ToolCall
from gateway.translate import ParsedChoice
from gateway.wires.choice_stream import CallFragment, ChoiceStream, StreamDelta

TextKind = Literal["reasoning", "text"]
REASONING: TextKind = "reasoning"
TEXT: TextKind = "text"
CALL = "call"


class BlockStream(ABC):
    """Ordering state of one choice's blocks, over its `ChoiceStream` (call fragments
    on); subclasses shape the events."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        completion_id: str,
        *,
        parse_tools: bool,
        stop: Sequence[str],
        tools: Sequence[Mapping[str, Any]] | None,
        logprobs: int | None = None,
    ) -> None:
        self.stream = ChoiceStream(
            tokenizer,
            completion_id=completion_id,
            parse_tools=parse_tools,
            stop=stop,
            logprobs=logprobs,
            tools=tools,
            call_fragments=True,
        )
        self.open: str | None = None
        """The open block's kind: "reasoning", "text" or "call" (None: none open)."""
        self.call = -1
        """The call index of the open call block."""
        self.opened = 0
        """Blocks opened so far."""
        self._done = 0
        """Calls completed so far (their blocks are closed)."""

    @property
    def result(self) -> ParsedChoice | None:
        """The finished choice (for the store and usage), once the stream ended."""
        return self.stream.result

    # ------------------------------------------------------------ what encoders shape

    @abstractmethod
    def on_open_text(self, kind: TextKind) -> None:
        """A reasoning or text block opens."""

    @abstractmethod
    def on_text(self, kind: TextKind, text: str) -> None:
        """Text for the open block of `kind`."""

    @abstractmethod
    def on_close_text(self, kind: TextKind) -> None:
        """The open text block closes (at the end too: `feed` of a step with
        `finished` set, which an encoder may look at first)."""

    @abstractmethod
    def on_open_call(self, index: int, head: ToolCall) -> None:
        """Call `index` opens with its id and name (`head.arguments` unused)."""

    @abstractmethod
    def on_arguments(self, index: int, text: str, whole: ToolCall | None) -> None:
        """Argument text of the open call. `whole`: the call, when it opened and
        completed within this step (the fragment may then be all its arguments)."""

    @abstractmethod
    def on_close_call(self, index: int, completed: ToolCall | None, superseded: bool) -> None:
        """The open call closes: `completed` (as parsed), else `superseded` or not."""

    @abstractmethod
    def owes_text(self, choice: ParsedChoice) -> bool:
        """At the end, with nothing open: whether an empty text block is still owed."""

    @abstractmethod
    def on_finish(self, choice: ParsedChoice) -> None:
        """The reply ended (after every block closed)."""

    # ------------------------------------------------------------ the ordering rules

    def feed(self, delta: StreamDelta) -> None:
        """The blocks of one step, in order, as hook calls."""
        if delta.reasoning:
            self._feed_text(REASONING, delta.reasoning)
        if not (delta.call_fragments or delta.tool_calls):
            if delta.content:
                if self.open == TEXT:  # the common step: one hook call
                    self.on_text(TEXT, delta.content)
                else:
                    self._feed_text(TEXT, delta.content)
        else:
            self._feed_calls(delta)
        if delta.finished is not None:
            self._feed_finish(delta.finished)

    def _feed_text(self, kind: TextKind, text: str) -> None:
        if self.open != kind:
            self._close_open()
            self._open_text(kind)
        self.on_text(kind, text)

    def _open_text(self, kind: TextKind) -> None:
        self.open = kind
        self.opened += 1
        self.on_open_text(kind)

    def _close_open(self, superseded: bool = False) -> None:
        kind = self.open
        if kind is None:
            return
        self.open = None
        if kind == CALL:
            self.on_close_call(self.call, None, superseded)
        else:
            self.on_close_text(REASONING if kind == REASONING else TEXT)

    def _feed_calls(self, delta: StreamDelta) -> None:
        """A step that carries call fragments or completes calls."""
        frags = delta.call_fragments
        done = self._done + len(delta.tool_calls)  # calls below this index are complete
        first_head = next((k for k, f in enumerate(frags) if f.head is not None), len(frags))
        for frag in frags[:first_head]:
            self._feed_arguments(frag, None)
        self._end_call(delta, done)
        if delta.content:
            self._feed_text(TEXT, delta.content)
        for frag in frags[first_head:]:
            if frag.head is None:
                whole = (
                    delta.tool_calls[frag.index - self._done]
                    if self._done <= frag.index < done
                    else None
                )
                self._feed_arguments(frag, whole)
                continue
            self._end_call(delta, done)
            self._close_open(superseded=True)
            self.open, self.call = CALL, frag.index
            self.opened += 1
            self.on_open_call(frag.index, frag.head)
        self._end_call(delta, done)
        self._done = done

    def _feed_arguments(self, frag: CallFragment, whole: ToolCall | None) -> None:
        if self.open == CALL and self.call == frag.index:
            self.on_arguments(frag.index, frag.arguments, whole)

    def _end_call(self, delta: StreamDelta, done: int) -> None:
        """Closes the open call if this step completed it."""
        if self.open == CALL and self.call < done:
            self.open = None
            self.on_close_call(self.call, delta.tool_calls[self.call - self._done], False)

    def _feed_finish(self, choice: ParsedChoice) -> None:
        self._close_open()
        if self.owes_text(choice):
            self._open_text(TEXT)
            self._close_open()
        self.on_finish(choice)
