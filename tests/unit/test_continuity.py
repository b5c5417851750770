"""Token continuity (`gateway/continuity.py`): the next turn's prompt is the earlier
completion's exact ids plus the template diff of the new messages, tokenized alone."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from areal_service.packing import pack_int32
from areal_service.sglang_protocol import FinishReason
from areal_service.types import RecentTurn
from gateway.continuity import (
    MAX_ENTRIES_PER_SESSION,
    Continuity,
    ContinuityCache,
    EndOfTurn,
    assistant_key,
)
from gateway.tokenizer import ChatTokenizer
from gateway.translate import GeneratedChoice, normalize_messages, parse_choice
from gateway.wires.responses.encode import output_items
from gateway.wires.responses.protocol import ResponsesRequest
from gateway.wires.responses.translate import responses_to_chat

IM_END = 2  # the tiny model's <|im_end|>
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
SESSION = "sess-1"


def make(tok: ChatTokenizer, enabled: bool = True) -> tuple[Continuity, Counter]:
    counter = Counter("continuity", "test", ["outcome"], registry=CollectorRegistry())
    return Continuity(tok, enabled=enabled, max_bytes=1 << 24, counter=counter), counter


def count(counter: Counter, outcome: str) -> float:
    return counter.labels(outcome)._value.get()


def non_canonical_ids(tok: ChatTokenizer, text: str) -> list[int]:
    """`text` as one id per character: what a sampler may produce, and what BPE never
    gives back when the text is re-tokenized."""
    ids = [i for ch in text for i in tok.core.encode(ch)]
    assert ids != tok.encode(text)
    return ids


def turn(
    cont: Continuity,
    tok: ChatTokenizer,
    messages: list[dict[str, Any]],
    output: list[int],
    finish: FinishReason,
    tools: Any = None,
) -> tuple[list[int], dict[str, Any], Any]:
    """One turn: prompt ids, then `output` generated; (prompt ids, the assistant message
    the gateway returns, the parsed choice)."""
    prompt, lineage = cont.prompt(SESSION, messages, tools, None)
    choice = parse_choice(
        tok,
        GeneratedChoice(tuple(output), finish=finish),
        completion_id="chatcmpl-1",
        parse_tools=bool(tools),
    )
    cont.remember(lineage, [SimpleNamespace(output_ids=tuple(output))], [choice])
    return prompt, choice.to_message(), choice


def test_next_prompt_is_earlier_ids_plus_new_tokens(tok: ChatTokenizer) -> None:
    cont, counter = make(tok)
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = [*non_canonical_ids(tok, "Hello there, friend"), IM_END]
    p1, reply, _ = turn(cont, tok, first, out, FinishReason("stop", matched=IM_END))
    assert p1 == tok.encode(tok.render(normalize_messages(first), None))

    second = [*first, reply, {"role": "user", "content": "And then?"}]
    p2, _ = cont.prompt(SESSION, second, None, None)
    full = tok.encode(tok.render(normalize_messages(second), None))
    new = tok.encode("\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n")
    assert p2 == p1 + out + new
    assert p2 != full  # what re-rendering gives: the sampled ids are lost
    assert full[-len(new) :] == new  # the new part tokenizes as in place
    assert count(counter, "continued") == 1 and count(counter, "no_match") == 1


@pytest.mark.parametrize(
    "finish", [FinishReason("length", length=5), FinishReason("stop", matched="STOP")]
)
def test_end_of_turn_added_when_output_lacks_it(tok: ChatTokenizer, finish: FinishReason) -> None:
    cont, _ = make(tok)
    first = [{"role": "user", "content": "Count"}]
    out = non_canonical_ids(tok, "one two STOP")
    p1, reply, _ = turn(cont, tok, first, out, finish)
    second = [*first, reply, {"role": "user", "content": "more"}]
    p2, _ = cont.prompt(SESSION, second, None, None)
    assert p2[: len(p1) + len(out)] == p1 + out
    assert p2[len(p1) + len(out) :] == tok.encode(
        "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tool_calls_continue_in_chat_and_responses_shapes(tok: ChatTokenizer) -> None:
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    out = [*tok.encode(call), IM_END]
    for shape in ("chat", "responses"):
        cont, counter = make(tok)
        first = [{"role": "user", "content": "add 2 and 3"}]
        p1, reply, choice = turn(cont, tok, first, out, FinishReason("stop", matched=IM_END), TOOLS)
        assert reply["content"] is None and reply["tool_calls"]
        call_id = reply["tool_calls"][0]["id"]
        if shape == "chat":
            second = [*first, reply, {"role": "tool", "tool_call_id": call_id, "content": "5"}]
        else:  # the client replays our output items as input items
            items = [
                *first,
                *output_items("resp_1", choice),
                {"type": "function_call_output", "call_id": call_id, "output": "5"},
            ]
            second, _, _ = responses_to_chat(ResponsesRequest(model="m", input=items))
        p2, _ = cont.prompt(SESSION, second, TOOLS, None)
        assert count(counter, "continued") == 1, shape
        assert p2 == p1 + out + tok.encode(
            "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )


def test_no_match_renders_fully(tok: ChatTokenizer) -> None:
    cont, counter = make(tok)
    first = [{"role": "user", "content": "Hi"}]
    out = [*non_canonical_ids(tok, "Hello there"), IM_END]
    _, reply, _ = turn(cont, tok, first, out, FinishReason("stop", matched=IM_END))
    edited = {**reply, "content": "Hello there!"}  # the client changed our reply
    for messages, tools in (
        ([*first, edited, {"role": "user", "content": "x"}], None),
        ([*first, reply, {"role": "user", "content": "x"}], TOOLS),
        ([{"role": "user", "content": "Hey"}, reply, {"role": "user", "content": "x"}], None),
    ):
        ids, _ = cont.prompt(SESSION, messages, tools, None)
        assert ids == tok.encode(tok.render(normalize_messages(messages), tools))
    assert count(counter, "continued") == 0 and count(counter, "no_match") == 4
    off, _ = make(tok, enabled=False)
    assert off.prompt(SESSION, first, None, None)[1] is None  # nothing remembered


def with_template(tiny_model_dir: Path, tmp_path: Path, template: str) -> ChatTokenizer:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, ckpt)
    (ckpt / "chat_template.jinja").write_text(template)
    return ChatTokenizer.from_pretrained(ckpt)


DROPS_EARLIER_REASONING = (
    "{%- set ns = namespace(last_user=0) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last_user -%}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{%- endif -%}"
    "{{ m.content }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
COUNTS_MESSAGES = (
    "<|im_start|>system\n{{ messages|length }} messages<|im_end|>\n"
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
PLAIN_TEXT = (
    "{%- for m in messages -%}{{ m.role }}: {{ m.content }}\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}assistant:{%- endif -%}"
)


@pytest.mark.parametrize(
    ("template", "outcome", "reasoning"),
    [
        (DROPS_EARLIER_REASONING, "not_prefix_stable", True),
        (COUNTS_MESSAGES, "prefix_changed", False),
        (PLAIN_TEXT, "no_end_of_turn", False),
    ],
)
def test_not_prefix_stable_templates_fall_back(
    tiny_model_dir: Path, tmp_path: Path, template: str, outcome: str, reasoning: bool
) -> None:
    tok = with_template(tiny_model_dir, tmp_path, template)
    cont, counter = make(tok)
    first = [{"role": "user", "content": "Hi"}]
    text = "<think>\nhmm\n</think>\n\nHello there" if reasoning else "Hello there"
    out = [*non_canonical_ids(tok, text), IM_END]
    _, reply, _ = turn(cont, tok, first, out, FinishReason("stop", matched=IM_END))
    assert bool(reply.get("reasoning_content")) == reasoning
    second = [*first, reply, {"role": "user", "content": "And then?"}]
    ids, lineage = cont.prompt(SESSION, second, None, None)
    assert ids == tok.encode(tok.render(normalize_messages(second), None))
    assert lineage is not None and lineage.outcome == outcome
    assert count(counter, outcome) == 1 and count(counter, "continued") == 0


def test_assistant_key_treats_none_and_empty_content_alike() -> None:
    base = {
        "role": "assistant",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    assert assistant_key({**base, "content": None}) == assistant_key({**base, "content": ""})
    assert assistant_key({**base, "content": "x"}) != assistant_key({**base, "content": ""})


def test_end_of_turn_is_the_last_added_token(tok: ChatTokenizer) -> None:
    eot = EndOfTurn(tok.core.added_tokens)
    assert eot.split("<tool_call>\n{}\n</tool_call><|im_end|>\n") == ("<|im_end|>", IM_END, "\n")
    assert eot.split("no markers") is None


def test_cache_is_bounded_lru(tok: ChatTokenizer) -> None:
    cont, _ = make(tok)
    first = [{"role": "user", "content": "Hi"}]
    out = [*non_canonical_ids(tok, "Hello"), IM_END]
    _, lineage = cont.prompt(SESSION, first, None, None)
    choice = parse_choice(
        tok,
        GeneratedChoice(tuple(out), finish=FinishReason("stop")),
        completion_id="c",
        parse_tools=False,
    )
    gen = [SimpleNamespace(output_ids=tuple(out))]
    cont.remember(lineage, gen, [choice])
    one = cont.cache.bytes
    cache = ContinuityCache(max_bytes=3 * one)
    for i in range(5):
        cache.add(f"s{i}", [e for e in cont.cache.entries(SESSION)])
    assert len(cache) == 3 and cache.bytes == 3 * one
    assert cache.entries("s0") == [] and cache.entries("s4")
    cache.entries("s2")  # used: s3 is now the oldest
    cache.add("s5", cont.cache.entries(SESSION))
    assert cache.entries("s3") == [] and cache.entries("s2")
    cache.forget("s2")
    assert cache.entries("s2") == [] and cache.bytes == 2 * one


def test_cache_bytes_count_only_the_entries_a_session_keeps(tok: ChatTokenizer) -> None:
    """Past `MAX_ENTRIES_PER_SESSION` the oldest entries fall off, one add at a time or
    several at once, and the byte total stays the sum over what is kept."""
    cont, _ = make(tok)
    entries = []
    for i in range(MAX_ENTRIES_PER_SESSION + 3):
        first = [{"role": "user", "content": "Hi " * (i + 1)}]
        out = [*non_canonical_ids(tok, "Hello"), IM_END]
        _, lineage = cont.prompt(f"t{i}", first, None, None)
        choice = parse_choice(
            tok,
            GeneratedChoice(tuple(out), finish=FinishReason("stop")),
            completion_id="c",
            parse_tools=False,
        )
        cont.remember(lineage, [SimpleNamespace(output_ids=tuple(out))], [choice])
        entries += cont.cache.entries(f"t{i}")
    cache = ContinuityCache(max_bytes=1 << 30)
    for entry in entries[:-2]:
        cache.add("s", [entry])
        assert cache.bytes == sum(e.weight for e in cache.entries("s"))
    cache.add("s", entries[-2:])
    kept = cache.entries("s")
    assert len(kept) == MAX_ENTRIES_PER_SESSION and kept[0] is entries[-2]
    assert cache.bytes == sum(e.weight for e in kept)
    cache.add("s", entries * 2)  # more new ones than a session keeps
    assert cache.bytes == sum(e.weight for e in cache.entries("s"))


def test_recall_continues_a_turn_another_process_served(tok: ChatTokenizer) -> None:
    """Process A serves a tool-call turn and records its key; process B, which never saw
    it, finds it through `recall` (the store's newest keyed turns) and continues its ids.
    A reply the store does not hold, or other tools, find nothing: a full render."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    out = [*tok.encode(call), IM_END]
    a = Continuity(tok, enabled=True, max_bytes=1 << 24, recent=lambda *_: [])
    first = [{"role": "user", "content": "add 2 and 3"}]
    p1, lineage = a.prompt(SESSION, first, TOOLS, None)
    choice = parse_choice(
        tok,
        GeneratedChoice(tuple(out), finish=FinishReason("stop", matched=IM_END)),
        completion_id="chatcmpl-1",
        parse_tools=True,
    )
    (key,) = a.keys(lineage, [choice])
    assert key is not None and key.startswith("1:")
    stored = [RecentTurn("chatcmpl-1", key, pack_int32(p1), pack_int32(out))]
    reply = choice.to_message()
    second = [
        *first,
        reply,
        {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "5"},
    ]
    reads: list[str] = []

    def recent(session_id: str, n: int) -> list[RecentTurn]:
        reads.append(session_id)
        return stored

    recalls = Counter("recalls", "test", ["result"], registry=CollectorRegistry())
    b = Continuity(
        tok,
        enabled=True,
        max_bytes=1 << 24,
        recent=recent,
        recalls=recalls,
        counter=Counter("c", "test", ["outcome"], registry=CollectorRegistry()),
    )
    assert not b.wants_recall(SESSION, first)  # no assistant message: nothing to extend
    assert not b.wants_recall(None, second)
    assert b.wants_recall(SESSION, second)
    assert b.recall(SESSION, second, TOOLS, None) and reads == [SESSION]
    p2, _ = b.prompt(SESSION, second, TOOLS, None)
    assert p2[: len(p1) + len(out)] == p1 + out
    assert not b.wants_recall(SESSION, second)  # remembered now
    assert count(recalls, "found") == 1

    injected = [*second[:1], {"role": "assistant", "content": "made up"}, *second[2:]]
    other_tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "name": "sum"}}]
    for messages, tools in ((injected, TOOLS), (second, other_tools)):
        c = Continuity(tok, enabled=True, max_bytes=1 << 24, recent=recent, recalls=recalls)
        assert not c.recall(SESSION, messages, tools, None)
        assert c.cache.entries(SESSION) == []
    assert count(recalls, "none") == 2
    off = Continuity(tok, enabled=True, max_bytes=1 << 24)  # capture off: no store
    assert not off.wants_recall(SESSION, second)
    _, off_lineage = off.prompt(SESSION, first, TOOLS, None)
    assert off_lineage is not None and off_lineage.digest is None
    assert off.keys(off_lineage, [choice]) == [None]  # nothing records them
