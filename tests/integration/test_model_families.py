"""Model families end to end: the tiny model, fine-tuned to call a tool in Qwen3-Coder's
XML format under Qwen3-Coder's chat template, served by the real engine behind the
gateway. The gateway picks the family's parser from the template by itself; the call
comes back as `tool_calls` (arguments typed by the tool's schema), whole and streamed;
the call replayed in history renders back to the model's tokens, so the two-turn tool
session exports ONE training sequence equal to the ids the engine was sent and produced.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chat_templates import QWEN3_CODER_TEMPLATE, tokenizer_dir_with_template
from harness import Gateway, run_gateway
from test_token_continuity import assert_one_exact_sequence, open_session, sequences_of
from tool_model import ToolExample, train_tool_model

from engine.testing import start_engine_in_thread
from gateway.tokenizer import ChatTokenizer
from gateway.translate import normalize_messages, render_prompt_ids

ADD = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}]
QUESTION = [{"role": "user", "content": "Please add 2 and 3."}]
XML_CALL = ("<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n"
            "<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>")
ANSWER = "The answer is 5."
IM_END = "<|im_end|>"


def _tool_round(call_id: str = "call_1") -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "5"}]


@pytest.fixture(scope="module")
def coder_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model under Qwen3-Coder's template, trained to answer QUESTION with
    XML_CALL and, after the tool result, with ANSWER (the second prompt as token
    continuity builds it: the first prompt + the call's ids + the new turn's ids)."""
    root = tmp_path_factory.mktemp("coder")
    tok = ChatTokenizer.from_pretrained(
        tokenizer_dir_with_template(tiny_model_dir, root / "tok", QWEN3_CODER_TEMPLATE))
    first = render_prompt_ids(tok, QUESTION, ADD, None)
    call = tok.encode(XML_CALL + IM_END)
    upto = tok.render(normalize_messages([*QUESTION, *_tool_round()[:1]]), ADD,
                      add_generation_prompt=False)
    full = tok.render(normalize_messages([*QUESTION, *_tool_round()]), ADD)
    assert full.startswith(upto) and upto.endswith(IM_END + "\n")
    second = [*first, *call, *tok.encode(full[len(upto) - 1:])]
    examples = [ToolExample(tuple(first), tuple(call)),
                ToolExample(tuple(second), tuple(tok.encode(ANSWER + IM_END)))]
    out = train_tool_model(tiny_model_dir, root / "model", examples)
    (out / "chat_template.jinja").write_text(QWEN3_CODER_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def coder_gateway(tmp_path_factory: pytest.TempPathFactory, coder_model_dir: Path
                  ) -> Iterator[Gateway]:
    with start_engine_in_thread(coder_model_dir) as url, run_gateway(
            tmp_path_factory.mktemp("gw"), coder_model_dir, [url],
            "gateway.sampling=client") as gw:
        yield gw


GREEDY: dict[str, Any] = {"temperature": 1.0, "extra_body": {"top_k": 1}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_qwen3_coder_tool_session_exports_one_sequence(coder_gateway: Gateway,
                                                       stream: bool) -> None:
    assert coder_gateway.state.tokenizer.output_parser.name == "qwen3_coder+think"
    session_id, client = open_session(coder_gateway)
    model = coder_gateway.config.gateway.model_name
    messages: list[dict[str, Any]] = list(QUESTION)
    if stream:
        chunks = list(client.chat.completions.create(model=model, messages=messages,
                                                     tools=ADD, stream=True, **GREEDY))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [t for d in deltas for t in d.tool_calls or ()]
        assert "".join(d.content or "" for d in deltas) == ""
        call_id, name = calls[0].id, calls[0].function.name
        arguments = "".join(t.function.arguments or "" for t in calls)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    else:
        first = client.chat.completions.create(model=model, messages=messages, tools=ADD,
                                               **GREEDY)
        assert first.choices[0].finish_reason == "tool_calls"
        assert first.choices[0].message.content is None
        (call,) = first.choices[0].message.tool_calls
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    assert (name, json.loads(arguments)) == ("add", {"a": 2, "b": 3})  # typed by the schema
    messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name,
                                                         "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "5"}]
    second = client.chat.completions.create(model=model, messages=messages, tools=ADD,
                                            **GREEDY)
    assert second.choices[0].message.content == ANSWER
    records, sequences = sequences_of(coder_gateway, session_id)
    assert len(records) == 2 and records[0].finish_reason == "tool_calls"
    assert_one_exact_sequence(records, sequences)
