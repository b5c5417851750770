"""A reply streamed through the gateway's chat stream, token chunk by token chunk, as the
tests that compare streams with whole parses (and with vLLM's streams) read it."""

from __future__ import annotations

from areal_service.sglang_protocol import FinishReason
from gateway.tokenizer import ChatTokenizer
from gateway.wires.choice_stream import ChoiceStream
from support.output_corpus import TOOLS


def stream_call_fragments(
    tok: ChatTokenizer, text: str, steps: list[int]
) -> tuple[str, str | None, list[tuple[str, str, str]], list[int]]:
    """`text`'s tokens through a chat stream (`call_fragments`) in steps of `steps`:
    (content, reasoning, [(id, name, arguments)] per call index as the fragments add up,
    how many argument fragments each call had)."""
    ids = tok.core.encode(text)
    stream = ChoiceStream(
        tok, completion_id="chatcmpl-t", parse_tools=True, tools=TOOLS, call_fragments=True
    )
    content, reasoning, pos = "", "", 0
    calls: list[list[str]] = []
    pieces: list[int] = []
    for step in steps:
        last = pos + step >= len(ids)
        delta = stream.push(
            ids[pos : pos + step],
            [0.0] * len(ids[pos : pos + step]),
            FinishReason("length", length=len(ids)) if last else None,
        )
        content += delta.content
        reasoning += delta.reasoning
        for frag in delta.call_fragments:
            if frag.head is not None:
                assert frag.index == len(calls)  # heads in order, before their arguments
                calls.append([frag.head.id, frag.head.name, ""])
                pieces.append(0)
            else:
                calls[frag.index][2] += frag.arguments
                pieces[frag.index] += 1
        pos += step
        if last:
            break
    return content, reasoning or None, [(c[0], c[1], c[2]) for c in calls], pieces
