"""The streamed path's per-token shortcuts give exactly what the whole-text way gives:
the backend's cumulative-chunk splice (`SuffixParser`), the Rust decode stream, the
plain-content fast path of `ChoiceStream` and the pre-encoded content chunk."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from areal_service.sglang_protocol import FinishReason, GenerateResponse
from gateway.stream_parse import ErrorEvent, SuffixParser
from gateway.tokenizer import ChatTokenizer, _WindowTextStream
from gateway.toolparse import held_suffix, parse_output
from gateway.wires.chat.encode import ChatStreamAssembler, dumps

TEXTS = [
    'The answer is 5. 😀 "quoted" \\ back\tslash\n',
    "<think>\nadd them 🤔\n</think>\n\nIt is 5.",
    'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {"q": "é \\"x\\" 😀"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "b", "arguments": {"n": [1, {"m": "}"}]}}\n</tool_call>',
    "plain text that mentions <tool and <think but never opens one </",
    "Thought: go\nObservation: 5 and more",
]


def sglang_chunk(
    ids: list[int], total: int, *, finish: Any = None, tops: bool = False, text: str = ""
) -> bytes:
    """A stream chunk as SGLang writes it (orjson: compact, text first)."""
    meta: dict[str, Any] = {
        "id": "r",
        "finish_reason": finish,
        "prompt_tokens": 7,
        "completion_tokens": total,
        "cached_tokens": 0,
        "weight_version": "3",
        "output_token_logprobs": [[-0.25 * (i + 1), t, None] for i, t in enumerate(ids)],
    }
    if tops:
        meta["output_top_logprobs"] = [[[-0.5, t, None], [-1.5, t + 1, None]] for t in ids]
    return json.dumps(
        {"text": text, "output_ids": ids, "meta_info": meta}, separators=(",", ":")
    ).encode()


def tokens_of(chunks: list[Any]) -> tuple[list[int], list[float]]:
    ids: list[int] = []
    lps: list[float] = []
    seen = 0
    for c in chunks:
        start = seen if c.cumulative else 0
        ids += c.output_ids[start:]
        lps += c.output_logprobs(start)
        seen += len(c.output_ids) - start
    return ids, lps


@pytest.mark.parametrize("tops", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_cumulative_chunks_cut_to_their_new_tokens(tops: bool, batch: int) -> None:
    rng = random.Random(batch)
    ids = [rng.choice([1, 12, 123, 1234, 5, 55]) for _ in range(40)]  # prefix traps
    wire = [
        sglang_chunk(
            ids[:k],
            k,
            tops=tops,
            text=f'say "x" {k}\\',
            finish={"type": "length", "length": 40} if k == 40 else None,
        )
        for k in range(1, 41)
    ]
    parser = SuffixParser()
    got: list[Any] = []
    for i in range(0, len(wire), batch):
        got += parser.chunks(wire[i : i + batch], coalesce=True)
    assert tokens_of(got) == (ids, [-0.25 * (i + 1) for i in range(40)])
    assert got[-1].finish_reason == FinishReason("length", length=40)
    assert got[-1].meta_info.weight_version == "3"
    if not tops:  # cut: from the second chunk on, only the new tokens
        assert all(not c.cumulative and len(c.output_ids) <= batch for c in got[1:])


def test_incremental_chunks_and_errors_are_parsed_whole() -> None:
    parser = SuffixParser()
    wire = [sglang_chunk([5], 1), sglang_chunk([5, 6], 3), sglang_chunk([7], 4)]
    got = parser.chunks(wire, coalesce=True)
    assert tokens_of(got) == ([5, 5, 6, 7], [-0.25, -0.25, -0.5, -0.25])
    error = b'{"error":{"message":"boom","code":500}}'
    assert SuffixParser().chunks([sglang_chunk([1], 1), error], coalesce=True)[1] == ErrorEvent(
        500, "boom"
    )
    # A chunk that does not extend the last one (another id, same leading bytes).
    parser = SuffixParser()
    first = parser.parse(sglang_chunk([12], 1))
    second = parser.parse(sglang_chunk([123, 4], 2))
    assert isinstance(first, GenerateResponse) and isinstance(second, GenerateResponse)
    assert second.output_ids == [123, 4]


def test_decode_stream_equals_the_window_decoder(tok: ChatTokenizer) -> None:
    rng = random.Random(0)
    text = "".join(TEXTS) + "🎉🤔 ünï 漢字"
    ids = tok.core.encode(text)
    for _ in range(5):
        rust, window = tok.decode_stream(), _WindowTextStream(tok)
        a = b = ""
        i = 0
        while i < len(ids):
            n = rng.randint(1, 3)
            a += rust.push(ids[i : i + n])
            b += window.push(ids[i : i + n])
            assert "\ufffd" not in a
            i += n
        assert a == b == tok.decode(ids)


def _reference_partial(text: str, stop: tuple[str, ...], parse_tools: bool) -> str:
    """What the stream may show before the end: the whole-text way."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    shown = text[: min(cuts)] if cuts else text[: len(text) - held_suffix(text, stop)]
    return parse_output(shown, parse_tools=parse_tools, id_seed="s", final=False).content


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("parse_tools", [True, False])
def test_content_fast_path_and_template_chunks(
    tok: ChatTokenizer, text: str, parse_tools: bool
) -> None:
    ids = tok.core.encode(text)
    stop = ("Observation:",)
    fast = ChatStreamAssembler(
        tok, completion_id="chatcmpl-t", model='m"1', created=5, parse_tools=parse_tools, stop=stop
    )
    slow = ChatStreamAssembler(
        tok, completion_id="chatcmpl-t", model='m"1', created=5, parse_tools=parse_tools, stop=stop
    )
    assert fast.start() == slow.start()
    shown = ""
    for k in range(len(ids)):
        finish = FinishReason("length", length=len(ids)) if k == len(ids) - 1 else None
        sse = fast.push_sse(ids[k : k + 1], [-0.1], finish)
        chunks = slow.push(ids[k : k + 1], [-0.1], finish)
        assert sse == "".join(f"data: {dumps(c)}\n\n" for c in chunks)
        shown += "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        if finish is None and "\ufffd" not in tok.decode(ids[: k + 1]):
            assert shown == _reference_partial(tok.decode(ids[: k + 1]), stop, parse_tools)
    assert fast.result == slow.result
    assert fast.result is not None and shown == (fast.result.content or "")
