"""gpt-oss's harmony format: the reply is a run of messages, each
`[<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL[ <|constrain|>json]<|message|>TEXT`
ended by `<|end|>`, `<|call|>` or `<|return|>` (the first message's `<|start|>assistant`
is in the prompt). `analysis` messages are reasoning, `final` ones (and `commentary`
without a recipient, preambles) content, and a message to `functions.NAME` a tool call
whose text is its arguments. Several reasoning or content messages join with "\\n", as
vLLM joins them. The markers are special tokens: replies are decoded keeping them.

Parsed from the decoded text rather than with `openai-harmony` (which works offline, in
vLLM's environment): that library reads token ids of gpt-oss's own vocabulary and would be
the gateway's first native dependency for one family; this module is checked against
vLLM's harmony parser, which uses it (`tests/integration/test_vllm_parsers.py`).

The reply's last marker, `<|call|>` or `<|return|>`, is the stop token the engine ends
on, which the reply's text never holds: at the end of the reply the last message is
complete (openai-harmony's `process_eos`, as vLLM reads it). So a reply cut off inside a
message keeps that message's meaning too (reasoning stays reasoning, a cut-off call is a
call whose arguments may not be JSON, as in vLLM).

Streaming: a message's text streams as it is generated once its header is complete; a
tool call comes when its message ends (at the latest with the last delta).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from gateway.toolparse.base import (
    ReasoningFormat,
    ToolCall,
    ToolFormat,
    held_suffix,
    tool_call_id,
)

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_HELD = (*ENDS, START)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"([^\s<]+)")


@dataclass(frozen=True, slots=True)
class Message:
    channel: str | None
    recipient: str | None
    text: str
    complete: bool
    raw: str
    """The message as generated, header and end marker included."""

    @property
    def kind(self) -> str:
        """ "tool", "reasoning", "content" or "ignore" (vLLM's classification)."""
        if self.recipient and _is_function(self.recipient):
            return "tool"
        if self.channel == "analysis":
            return "reasoning"
        if self.channel == "final" or (self.channel == "commentary" and not self.recipient):
            return "content"
        return "ignore"


def _is_function(recipient: str) -> bool:
    if recipient.startswith("functions."):
        return len(recipient) > len("functions.")
    return recipient not in ("assistant", "browser", "python", "container") and recipient.split(
        ".", 1
    )[0] not in ("browser", "python", "container")


def messages(text: str, final: bool) -> list[Message]:
    """The messages of `text`; the last may be incomplete (`complete` False). With
    `final` False, the unfinished message's text holds back a possible end marker."""
    out = []
    for i, part in enumerate(text.split(START)):
        if not part and i == 0:
            continue
        head, sep, body = part.partition(MESSAGE)
        if not sep:
            if part.strip() or i:
                out.append(Message(None, None, "", False, (START if i else "") + part))
            continue
        recipient = _RECIPIENT.search(head)
        channel = _CHANNEL.search(head)
        ends = [(body.find(e), e) for e in ENDS if e in body]
        if ends:
            at, end = min(ends)
            raw = (START if i else "") + head + MESSAGE + body[: at + len(end)]
            out.append(
                Message(
                    channel and channel.group(1),
                    recipient and recipient.group(1),
                    body[:at],
                    True,
                    raw,
                )
            )
            rest = body[at + len(end) :]
            if rest.strip():  # text after an end marker, outside any message
                out.append(Message(None, None, "", False, rest))
            continue
        shown = body if final else body[: len(body) - held_suffix(body, _HELD)]
        out.append(
            Message(
                channel and channel.group(1),
                recipient and recipient.group(1),
                shown,
                final,
                (START if i else "") + part,
            )
        )
    return out


class HarmonyReasoning(ReasoningFormat):
    """The `analysis` messages; the rest of the reply goes on to `GptOssToolFormat`."""

    name: ClassVar[str] = "harmony"
    open: ClassVar[str | None] = CHANNEL
    close: ClassVar[str | None] = "<|end|>"

    def split(self, text: str, final: bool) -> tuple[str | None, str] | None:
        found = messages(text, final)
        parts = [m for m in found if m.kind == "reasoning"]
        if not parts:
            return None, text
        rest = "".join(m.raw for m in found if m.kind != "reasoning")
        return "\n".join(m.text for m in parts), rest

    def pending(self, text: str) -> bool:
        return True  # every step is parsed whole: the reply is all markup


class GptOssToolFormat(ToolFormat):
    name: ClassVar[str] = "gpt_oss"
    special_markers: ClassVar[bool] = True
    markers: ClassVar[tuple[str, ...]] = _HELD
    arguments_as_mapping: ClassVar[bool] = True
    """gpt-oss's template writes a replayed call's arguments with `tojson`."""

    def split(
        self, text: str, final: bool, id_seed: str, tools: Sequence[Mapping[str, Any]] | None
    ) -> tuple[str, tuple[ToolCall, ...]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        for m in messages(text, final):
            kind = m.kind
            if kind == "content":
                content.append(m.text)
            elif kind == "tool" and m.complete:
                name = m.recipient.removeprefix("functions.")  # type: ignore[union-attr]
                calls.append(ToolCall(tool_call_id(id_seed, len(calls)), name, m.text))
            elif final and m.channel is None and m.raw.strip():
                content.append(m.raw)  # text outside any message: kept as text
        return "\n".join(content), tuple(calls)

    def plain_prefix(self, text: str, scan: int) -> tuple[str, int] | None:
        return None  # all markup: parsed whole (`HarmonyReasoning.pending`)

    def content_only(self, text: str, final: bool) -> str:
        return self.split(text, final, "", None)[0]
