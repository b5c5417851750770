"""Model families end to end: for each family with a template here, the tiny model is
fine-tuned to call a tool in that family's format under that template and served by the
real engine behind the gateway. The gateway picks the family's parser from the template
by itself; the call comes back as `tool_calls` (arguments typed by the tool's schema
where the format types them), whole and streamed; the call replayed in history renders
back to the model's tokens, so the two-turn tool session exports ONE training sequence
equal to the ids the engine was sent and produced.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from support.chat_templates import (
    DEEPSEEK_V3_TEMPLATE,
    GLM45_TEMPLATE,
    GPT_OSS_TEMPLATE,
    KIMI_K2_TEMPLATE,
    LLAMA4_PYTHONIC_TEMPLATE,
    LLAMA31_TEMPLATE,
    MISTRAL_TOOLS_TEMPLATE,
    QWEN3_CODER_TEMPLATE,
    tokenizer_dir_with_template,
)
from support.harness import ADMIN_KEY, Gateway, run_gateway
from support.tool_model import ToolExample, train_tool_model
from test_token_continuity import (
    assert_one_exact_sequence,
    open_session,
    outcome_count,
    sequences_of,
)

from engine.testing import start_engine_in_thread
from gateway.tokenizer import ChatTokenizer
from gateway.translate import normalize_messages, render_prompt_ids

ADD = [
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
QUESTION = [{"role": "user", "content": "Please add 2 and 3."}]
ANSWER = "The answer is 5."
IM_END = "<|im_end|>"
"""The tiny model's end-of-turn (and EOS) token: every template here ends a turn with it."""


@dataclass(frozen=True, slots=True)
class Family:
    template: str
    call: str
    """The model's reply: the `add(2, 3)` call in the family's format."""
    parser: str
    call_id: str | None = None
    """The id the gateway must return (the model's own, where the format has one)."""
    arguments: str = '{"a": 2, "b": 3}'
    """The call's arguments as the gateway returns them."""
    reasoning: str | None = None
    """The reasoning the call's reply holds (sent back with the call, as `reasoning_content`)."""
    answer: str = ANSWER
    """The model's reply after the tool result (its content is ANSWER)."""
    answer_breaks: str | None = None
    """Why a user turn after the answer cannot continue the sequence, where the family's
    template re-renders the answer differently by design (None: it continues)."""


FAMILIES = {
    "qwen3_coder": Family(
        QWEN3_CODER_TEMPLATE,
        "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n"
        "<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>",
        "qwen3_coder+think",
    ),
    "deepseek_v3": Family(
        DEEPSEEK_V3_TEMPLATE,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n"
        '```json\n{"a": 2, "b": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "deepseek_v3+think",
    ),
    "kimi_k2": Family(
        KIMI_K2_TEMPLATE,
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0"
        '<|tool_call_argument_begin|>{"a": 2, "b": 3}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        "kimi_k2+think",
        "functions.add:0",
    ),
    "mistral": Family(
        MISTRAL_TOOLS_TEMPLATE,
        '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}',
        "mistral+none",
        answer_breaks="Mistral's template writes the tool list before the "
        "last user message, so a new user message moves it",
    ),
    # The tiny model has no <|eot_id|>: its <|im_end|> ends Llama's turns here.
    "llama3_json": Family(
        LLAMA31_TEMPLATE.replace("<|eot_id|>", IM_END),
        '{"name": "add", "parameters": {"a": 2, "b": 3}}',
        "llama3_json+none",
    ),
    # vLLM's Llama 4 template writes every value as a quoted string: the model writes
    # them so (an unquoted `a=2` would re-render as `a="2"`: see the docs).
    "llama4_pythonic": Family(
        LLAMA4_PYTHONIC_TEMPLATE.replace("<|eot|>", IM_END),
        '[add(a="2", b="3")]',
        "llama4_pythonic+none",
        arguments='{"a": "2", "b": "3"}',
    ),
    # GLM ends a turn with the next message's role token; the tool results' one,
    # <|observation|>, is the tiny model's <|im_end|> here. Reasoning of a turn after the
    # last user message is kept, so the call's block (empty here) re-renders.
    "glm45": Family(
        GLM45_TEMPLATE.replace("<|observation|>", IM_END),
        "\n<think></think>\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2"
        "</arg_value>\n<arg_key>b</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        "glm45+glm",
        answer="\n<think></think>\n" + ANSWER,
    ),
    # The call's stop token <|call|> is the tiny model's <|im_end|> here; its analysis
    # message comes back as reasoning and re-renders from the replayed `thinking`.
    "gpt_oss": Family(
        GPT_OSS_TEMPLATE.replace("<|call|>", IM_END),
        "<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant "
        "to=functions.add<|channel|>commentary json<|message|>"
        '{"a": 2, "b": 3}',
        "gpt_oss+harmony",
        reasoning="Add them.",
        answer="<|channel|>final<|message|>" + ANSWER,
        answer_breaks="harmony ends a final answer with <|return|>, which "
        "history renders as <|end|>, and drops the answer's analysis",
    ),
}


def _tool_round(
    family: Family, call_id: str, arguments: str, reasoning: str | None
) -> list[dict[str, Any]]:
    """The call as a client sends it back (with its reasoning, for a family that returns
    one), and the tool result."""
    call: dict[str, Any] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "add", "arguments": arguments}}
        ],
    }
    if family.reasoning is not None:
        call["reasoning_content"] = reasoning
    return [call, {"role": "tool", "tool_call_id": call_id, "content": "5"}]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> tuple[str, Path]:
    """The tiny model under the family's template, trained to answer QUESTION with the
    family's call and, after the tool result, with ANSWER (the second prompt as token
    continuity builds it: the first prompt + the call's ids + the new turn's ids)."""
    name: str = request.param
    family = FAMILIES[name]
    root = tmp_path_factory.mktemp(name)
    tok = ChatTokenizer.from_pretrained(
        tokenizer_dir_with_template(tiny_model_dir, root / "tok", family.template)
    )
    assert tok.output_parser.name == family.parser
    first = render_prompt_ids(tok, QUESTION, ADD, None)
    call = tok.encode(family.call + IM_END)
    turn = _tool_round(family, family.call_id or "call_1", family.arguments, family.reasoning)
    full = tok.render(normalize_messages([*QUESTION, *turn]), ADD)
    # The template renders the replayed call back to exactly the reply (+ its end token).
    at = len(tok.render(normalize_messages(QUESTION), ADD)) + len(family.call + IM_END)
    assert full[:at].endswith(family.call + IM_END), full
    second = [*first, *call, *tok.encode(full[at:])]
    examples = [
        ToolExample(tuple(first), tuple(call)),
        ToolExample(tuple(second), tuple(tok.encode(family.answer + IM_END))),
    ]
    out = train_tool_model(tiny_model_dir, root / "model", examples)
    (out / "chat_template.jinja").write_text(family.template)
    return name, out


@pytest.fixture(scope="module")
def family_gateway(
    tmp_path_factory: pytest.TempPathFactory, family_model: tuple[str, Path]
) -> Iterator[tuple[str, Gateway]]:
    name, model_dir = family_model
    with (
        start_engine_in_thread(model_dir) as url,
        run_gateway(
            tmp_path_factory.mktemp("gw"), model_dir, [url], "gateway.sampling.mode=client"
        ) as gw,
    ):
        yield name, gw


STREAMED_ARGUMENTS = {"deepseek_v3", "glm45", "kimi_k2", "mistral", "qwen3_coder"}
"""Families whose calls' arguments stream as they are generated (their JSON text, or a
typed value at a time)."""
GREEDY: dict[str, Any] = {"temperature": 1.0, "extra_body": {"top_k": 1}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_session_exports_one_sequence(
    family_gateway: tuple[str, Gateway], stream: bool
) -> None:
    name, gw = family_gateway
    family = FAMILIES[name]
    assert gw.state.tokenizer.output_parser.name == family.parser
    session_id, client = open_session(gw)
    model = gw.config.gateway.model_name
    messages: list[dict[str, Any]] = list(QUESTION)
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=model, messages=messages, tools=ADD, stream=True, **GREEDY
            )
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [t for d in deltas for t in d.tool_calls or ()]
        assert "".join(d.content or "" for d in deltas) == ""
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        call_id, fn_name = calls[0].id, calls[0].function.name
        arguments = "".join(t.function.arguments or "" for t in calls)
        if name in STREAMED_ARGUMENTS:  # the name first, then the arguments as generated
            assert calls[0].function.arguments == ""
            assert len([t for t in calls if t.function.arguments]) > 1
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    else:
        first = client.chat.completions.create(model=model, messages=messages, tools=ADD, **GREEDY)
        assert first.choices[0].finish_reason == "tool_calls"
        assert first.choices[0].message.content is None
        (call,) = first.choices[0].message.tool_calls
        call_id, fn_name, arguments = call.id, call.function.name, call.function.arguments
        reasoning = getattr(first.choices[0].message, "reasoning_content", None) or ""
    assert (fn_name, json.loads(arguments)) == ("add", json.loads(family.arguments))
    assert reasoning == (family.reasoning or "")
    if family.call_id is not None:
        assert call_id == family.call_id
    messages += _tool_round(family, call_id, arguments, reasoning)
    second = client.chat.completions.create(model=model, messages=messages, tools=ADD, **GREEDY)
    assert second.choices[0].message.content == ANSWER
    records, sequences = sequences_of(gw, session_id)
    assert len(records) == 2 and records[0].finish_reason == "tool_calls"
    assert_one_exact_sequence(records, sequences)
    if stream:
        return
    # A user turn after the answer: it continues the sequence, except where the
    # family's template rewrites the answer in history (then a new sequence, counted).
    messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Thanks."}]
    fallbacks = _fallbacks(gw)
    client.chat.completions.create(
        model=model, messages=messages, tools=ADD, max_tokens=1, **GREEDY
    )
    records, sequences = sequences_of(gw, session_id)
    if family.answer_breaks is None:
        assert_one_exact_sequence(records, sequences)
    else:
        assert len(sequences) == 2, family.answer_breaks
        assert _fallbacks(gw) == fallbacks + 1


ANTHROPIC_ADD = [
    {
        "name": "add",
        "description": "Add two integers.",
        "input_schema": ADD[0]["function"]["parameters"],
    }
]
RESPONSES_ADD = [{"type": "function", **ADD[0]["function"]}]


def test_call_streams_alike_on_every_protocol(family_gateway: tuple[str, Gateway]) -> None:
    """The first turn's call through the Anthropic Messages and Responses routes, streamed
    with each SDK's stream helper: the call opens with its name (empty input / arguments),
    its arguments follow as generated, adding up byte for byte to the Chat Completions
    call's arguments, and the SDK's final message / response holds the whole call."""
    name, gw = family_gateway
    model = gw.config.gateway.model_name
    oa = openai.OpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0)
    whole = oa.chat.completions.create(model=model, messages=QUESTION, tools=ADD, **GREEDY)
    (call,) = whole.choices[0].message.tool_calls or ()
    arguments = call.function.arguments
    assert json.loads(arguments) == json.loads(FAMILIES[name].arguments)
    several = name in STREAMED_ARGUMENTS

    ac = anthropic.Anthropic(base_url=gw.url, api_key=ADMIN_KEY, max_retries=0)
    kwargs: dict[str, Any] = {
        "model": model,
        "max_tokens": 256,
        "messages": QUESTION,
        "tools": ANTHROPIC_ADD,
        "extra_body": {"temperature": 1.0, "top_k": 1},
    }
    with ac.messages.stream(**kwargs) as s:
        events = list(s)
        message = s.get_final_message()
    starts = [
        e.content_block
        for e in events
        if e.type == "content_block_start" and e.content_block.type == "tool_use"
    ]
    assert [(b.name, b.input) for b in starts] == [("add", {})]
    fragments = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert "".join(fragments) == arguments
    assert len(fragments) > 1 if several else len(fragments) >= 1
    (use,) = [b for b in message.content if b.type == "tool_use"]
    (whole_use,) = [b for b in ac.messages.create(**kwargs).content if b.type == "tool_use"]
    assert use.input == whole_use.input == json.loads(arguments)

    with oa.responses.stream(
        model=model,
        input=QUESTION[0]["content"],
        tools=RESPONSES_ADD,
        temperature=1.0,
        extra_body={"top_k": 1},
    ) as rs:
        revents = list(rs)
        response = rs.get_final_response()
    added = [
        e.item
        for e in revents
        if e.type == "response.output_item.added" and e.item.type == "function_call"
    ]
    assert [(i.name, i.arguments) for i in added] == [("add", "")]
    deltas = [e.delta for e in revents if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == arguments
    assert len(deltas) > 1 if several else len(deltas) >= 1
    (fc,) = [i for i in response.output if i.type == "function_call"]
    assert (fc.name, fc.arguments) == ("add", arguments)


def _fallbacks(gw: Gateway) -> float:
    """Turns whose prompt fell back to a full render because the template rewrote the
    history (`areal_token_continuity_total`)."""
    return sum(
        outcome_count(gw, o) for o in ("prefix_changed", "not_prefix_stable", "no_end_of_turn")
    )
