"""Output parsers per model family (`gateway/toolparse/`): the registry's choice and its
overrides, one warning for a format not parsed, each family's calls and reasoning, the
streamed deltas (random chunkings through `ChoiceStream`, fast path included) adding up
to the whole parse, and the reverse direction: a parsed reply replayed as history
renders back, through the family's template, to exactly the generated text."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
from support.chat_templates import (
    DEEPSEEK_V3_TEMPLATE,
    GLM45_TEMPLATE,
    GPT_OSS_TEMPLATE,
    KIMI_K2_TEMPLATE,
    LLAMA4_PYTHONIC_TEMPLATE,
    LLAMA31_TEMPLATE,
    MINIMAX_LIKE_TEMPLATE,
    MISTRAL_TOOLS_TEMPLATE,
    QWEN3_CODER_TEMPLATE,
    SMOLLM2_TEMPLATE,
    tokenizer_dir_with_template,
)
from support.output_corpus import FAMILIES, FAMILY_PARSERS, TOOLS
from support.streaming import stream_call_fragments

from areal_service.config import ReasoningParserName, ToolParserName
from areal_service.sglang_protocol import FinishReason
from gateway.tokenizer import ChatTokenizer
from gateway.toolparse import OutputParser, ParsedText
from gateway.toolparse.registry import REASONING_FORMATS, TOOL_FORMATS, select_parser
from gateway.translate import id_seed
from gateway.wires.choice_stream import ChoiceStream

SEED = id_seed("chatcmpl-t", 0)


def parser_for(family: str) -> OutputParser:
    tool_format, generation_prompt = FAMILY_PARSERS[family]
    return select_parser(
        None,
        {},
        tool_parser=tool_format,
        renders_tools=False,
        reasoning_parser="mistral" if family == "magistral" else None,
        generation_prompt=generation_prompt,
    ).parser


def parse(family: str, text: str, final: bool = True) -> ParsedText:
    return parser_for(family).parse(text, parse_tools=True, id_seed=SEED, final=final, tools=TOOLS)


# ---------------------------------------------------------------- the registry


def test_settings_list_exactly_the_registered_formats() -> None:
    assert set(ToolParserName.__args__) == set(TOOL_FORMATS)  # type: ignore[attr-defined]
    assert set(ReasoningParserName.__args__) == set(REASONING_FORMATS)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("template", "config", "expected"),
    [
        (QWEN3_CODER_TEMPLATE, {}, "qwen3_coder+think"),
        (LLAMA31_TEMPLATE, {}, "llama3_json+none"),
        (MISTRAL_TOOLS_TEMPLATE, {}, "mistral+none"),
        ("{{ '[THINK]' + '[TOOL_CALLS]' }}", {}, "mistral+mistral"),
        (DEEPSEEK_V3_TEMPLATE, {}, "deepseek_v3+think"),
        (KIMI_K2_TEMPLATE, {}, "kimi_k2+think"),
        (GLM45_TEMPLATE, {}, "glm45+glm"),
        (GPT_OSS_TEMPLATE, {}, "gpt_oss+harmony"),
        (LLAMA4_PYTHONIC_TEMPLATE, {}, "llama4_pythonic+none"),
        ("{{ '<tool_call>' }}", {}, "hermes+think"),
        ({"default": "x", "tool_use": QWEN3_CODER_TEMPLATE}, {}, "qwen3_coder+think"),
        (SMOLLM2_TEMPLATE, {"architectures": ["LlamaForCausalLM"]}, "hermes+think"),
        (SMOLLM2_TEMPLATE, {"architectures": ["Qwen3ForCausalLM"]}, "hermes+think"),
    ],
    ids=[
        "qwen3_coder",
        "llama31",
        "mistral",
        "magistral",
        "deepseek_v3",
        "kimi_k2",
        "glm45",
        "gpt_oss",
        "llama4_pythonic",
        "hermes",
        "named_templates",
        "arch_llama_too_generic",
        "arch_qwen3",
    ],
)
def test_chosen_from_template_then_architecture(template: str, config: dict, expected: str) -> None:
    assert select_parser(template, config).parser.name == expected


def test_settings_override_the_choice() -> None:
    chosen = select_parser(QWEN3_CODER_TEMPLATE, {}, tool_parser="hermes", reasoning_parser="none")
    assert chosen.parser.name == "hermes+none"
    assert "gateway.tool_parser" in chosen.reason


def test_unknown_format_warns_once_at_load(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    minimax = tokenizer_dir_with_template(tiny_model_dir, tmp_path / "m", MINIMAX_LIKE_TEMPLATE)
    with caplog.at_level(logging.WARNING, logger="gateway.toolparse.registry"):
        tok = ChatTokenizer.from_pretrained(minimax)
        assert tok.renders_tools
        for _ in range(3):  # requests parse with the parser chosen at load: no new warning
            tok.output_parser.parse("<minimax:tool_call>", parse_tools=True, id_seed="s")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "MiniMax M2" in warnings[0]
    assert "tool calls will come back as text" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gateway.toolparse.registry"):
        ChatTokenizer.from_pretrained(minimax, tool_parser="none")  # the user decided
        ChatTokenizer.from_pretrained(  # renders no tools: the tokenizer's own warning
            tokenizer_dir_with_template(tiny_model_dir, tmp_path / "s", SMOLLM2_TEMPLATE)
        )
    assert not [r for r in caplog.records if r.name == "gateway.toolparse.registry"]


def test_tokenizer_loads_with_the_templates_parser(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert ChatTokenizer.from_pretrained(tiny_model_dir).output_parser.name == "hermes+think"
    coder = ChatTokenizer.from_pretrained(
        tiny_model_dir, chat_template=str(_write(tmp_path, QWEN3_CODER_TEMPLATE))
    )
    assert coder.output_parser.name == "qwen3_coder+think"
    assert coder.think_close_id is not None  # the tiny model has </think> as one token
    llama = ChatTokenizer.from_pretrained(
        tiny_model_dir, tool_parser="llama3_json", reasoning_parser="none"
    )
    assert (llama.output_parser.name, llama.think_close_id) == ("llama3_json+none", None)


def _write(tmp_path: Path, template: str) -> Path:
    path = tmp_path / "template.jinja"
    path.write_text(template)
    return path


# ---------------------------------------------------------------- the formats


def test_qwen3_coder_values_take_their_types_from_the_schema() -> None:
    case = {c.name: c for c in FAMILIES["qwen3_coder"]}
    out = parse("qwen3_coder", case["two_calls"].text)
    assert [c.name for c in out.tool_calls] == ["get_weather", "search"]
    assert [json.loads(c.arguments) for c in out.tool_calls] == [
        {"city": "Paris", "metric": True},
        {"query": "rain", "filters": {"a": [1, {"b": None}]}, "tags": ["x", "ü"], "limit": 2.5},
    ]
    assert json.loads(
        parse("qwen3_coder", case["untyped_string_like_number"].text).tool_calls[0].arguments
    ) == {"query": "42"}  # the schema says string
    no_schema = parser_for("qwen3_coder").parse(
        case["one_call"].text, parse_tools=True, id_seed=SEED
    )
    assert json.loads(no_schema.tool_calls[0].arguments) == {"city": "Paris", "days": "3"}
    assert parse("qwen3_coder", case["think_then_call"].text).reasoning == "Need the weather."


def test_qwen3_coder_malformed_or_truncated_stays_content() -> None:
    bad = "<tool_call>\n<function=f>\nstray\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    assert parse("qwen3_coder", bad) == ParsedText(bad, None, ())
    cut = {c.name: c for c in FAMILIES["qwen3_coder"]}["truncated"].text
    assert parse("qwen3_coder", cut) == ParsedText(cut, None, ())


def test_llama3_calls_are_the_whole_reply() -> None:
    case = {c.name: c for c in FAMILIES["llama3_json"]}
    two = parse("llama3_json", case["two_calls"].text)
    assert (two.content, [c.name for c in two.tool_calls]) == ("", ["get_weather", "search"])
    assert two.tool_calls[1].arguments == '{"query": "東京", "filters": {"a": [1, {"b": null}]}}'
    compact = parse("llama3_json", case["compact_json"].text).tool_calls[0]
    assert compact.arguments == '{"query":"☔ \\"q\\""}'  # the model's exact text
    for name in ("truncated", "json_in_prose", "plain"):
        assert parse("llama3_json", case[name].text) == ParsedText(case[name].text, None, ())
    assert parse("llama3_json", "<think>\nx\n</think>\n\nhi").reasoning is None  # no think


def test_section_formats() -> None:
    """DeepSeek V3 / V3.1 and Kimi K2: content before the section, calls in order, Kimi's
    own call ids kept (its template writes them back), a cut-off section kept as text."""
    case = {f: {c.name: c for c in FAMILIES[f]} for f in ("deepseek_v3", "deepseek_v31", "kimi_k2")}
    for family in case:
        out = parse(family, case[family]["content_then_call"].text)
        assert out.content == "Let me check.", family
        two = parse(family, case[family]["two_calls"].text)
        assert [c.name for c in two.tool_calls] == ["get_weather", "search"], family
        assert json.loads(two.tool_calls[0].arguments) == {"city": "Paris"}
        assert json.loads(two.tool_calls[1].arguments)["filters"] == {"a": [1, {"b": None}]}
        assert json.loads(two.tool_calls[1].arguments)["query"].startswith("東京")
        cut = case[family]["truncated"].text
        assert parse(family, cut) == ParsedText(cut, None, ())
    kimi = parse("kimi_k2", case["kimi_k2"]["two_calls"].text)
    assert [c.id for c in kimi.tool_calls] == ["functions.get_weather:0", "functions.search:1"]
    assert parse("deepseek_v3", case["deepseek_v31"]["one_call"].text).tool_calls == ()


def test_glm_values_take_their_types_from_the_schema() -> None:
    case = {c.name: c for c in FAMILIES["glm45"]}
    two = parse("glm45", case["two_calls"].text)
    assert [(c.name, json.loads(c.arguments)) for c in two.tool_calls] == [
        ("get_weather", {"city": "Paris", "metric": True}),
        ("search", {"query": "東京 ☔", "filters": {"a": [1, {"b": None}]}, "tags": ["x"]}),
    ]
    assert parse("glm45", case["content_then_call"].text).content == "Let me check."
    assert parse("glm45", case["think_then_call"].text).reasoning == "Need the weather."
    stray = "<tool_call>f\nstray<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    assert parse("glm45", stray) == ParsedText(stray, None, ())


def test_llama4_pythonic_literals_become_json() -> None:
    case = {c.name: c for c in FAMILIES["llama4_pythonic"]}
    two = parse("llama4_pythonic", case["two_calls"].text)
    assert [(c.name, json.loads(c.arguments)) for c in two.tool_calls] == [
        ("get_weather", {"city": "Paris", "metric": True}),
        ("search", {"query": "東京 ☔", "filters": {"a": [1, {"b": None}]}, "limit": -2.5}),
    ]
    assert json.loads(parse("llama4_pythonic", case["json_names"].text).tool_calls[0].arguments)[
        "filters"
    ] == {"on": True, "off": None}
    for text in ("[get_weather(city=open('x'))]", "[get_weather('Paris')]", "[f(x=1)] and"):
        assert parse("llama4_pythonic", text) == ParsedText(text, None, ())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_corpus_call_counts(family: str) -> None:
    for case in FAMILIES[family]:
        assert len(parse(family, case.text).tool_calls) == case.calls, case.name


def test_prompt_opened_think_reads_the_reply_as_reasoning_first(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    opened = QWEN3_CODER_TEMPLATE.replace(
        "'<|im_start|>assistant\\n' }}", "'<|im_start|>assistant\\n<think>\\n' }}"
    )
    assert opened != QWEN3_CODER_TEMPLATE
    tok = ChatTokenizer.from_pretrained(
        tokenizer_dir_with_template(tiny_model_dir, tmp_path / "t", opened)
    )
    assert tok.output_parser.reasoning.name == "think(opened by the prompt)"
    case = {c.name: c for c in FAMILIES["qwen3_thinking"]}
    assert parse("qwen3_thinking", case["reasoning_then_content"].text) == ParsedText(
        "It is 5.", "Let me think 🤔.", ()
    )
    assert parse("qwen3_thinking", case["cut_in_reasoning"].text) == ParsedText(
        "", "Still thinking about Köln", ()
    )
    assert parse("qwen3_thinking", case["open_repeated"].text) == ParsedText("OK.", "Hmm.", ())
    assert parse("hermes", case["reasoning_then_content"].text).reasoning is None


# ---------------------------------------------------------------- streaming


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stream_deltas_add_up_to_the_whole_parse(tok: ChatTokenizer, family: str) -> None:
    """Each case, tokenized by the tiny model and fed in random chunkings through
    `ChoiceStream` (fast path and all): the deltas concatenate to the whole parse, and
    every partial parse is a prefix of it."""
    tok = ChatTokenizer(tok.core, output_parser=parser_for(family))
    rng = random.Random(family)
    for case in FAMILIES[family]:
        ids = tok.core.encode(case.text)
        assert tok.decode(ids) == case.text, case.name
        whole = tok.output_parser.parse(case.text, parse_tools=True, id_seed=SEED, tools=TOOLS)
        for _ in range(8):
            stream = ChoiceStream(tok, completion_id="chatcmpl-t", parse_tools=True, tools=TOOLS)
            reasoning = content = ""
            calls: list = []
            pos = 0
            while pos < len(ids):
                step = rng.randint(1, 6)
                last = pos + step >= len(ids)
                delta = stream.push(
                    ids[pos : pos + step],
                    [0.0] * len(ids[pos : pos + step]),
                    FinishReason("length", length=len(ids)) if last else None,
                )
                reasoning += delta.reasoning
                content += delta.content
                calls += delta.tool_calls
                pos += step
            assert (content, reasoning or None, tuple(calls)) == (
                whole.content,
                whole.reasoning,
                whole.tool_calls,
            ), case.name
        for cut in range(len(case.text) + 1):
            part = tok.output_parser.parse(
                case.text[:cut], parse_tools=True, id_seed=SEED, final=False, tools=TOOLS
            )
            assert whole.content.startswith(part.content), (case.name, cut)
            assert (whole.reasoning or "").startswith(part.reasoning or ""), (case.name, cut)
            assert whole.tool_calls[: len(part.tool_calls)] == part.tool_calls, (case.name, cut)


STREAMED_ARGUMENTS = {
    "hermes",
    "qwen3_thinking",
    "mistral",
    "magistral",
    "deepseek_v3",
    "deepseek_v31",
    "kimi_k2",
    "qwen3_coder",
    "glm45",
}
"""Families whose arguments stream as they are generated (the model's JSON text; for
Qwen3-Coder and GLM a typed value at a time); the others' calls come whole when they
close (or with the last delta)."""
PARTIAL_CALL_STREAMED = {
    ("hermes", "truncated"),
    ("mistral", "truncated"),
    ("deepseek_v31", "truncated"),
    ("kimi_k2", "truncated"),
    ("qwen3_coder", "truncated"),
    ("glm45", "truncated"),
}
"""Cut-off calls whose name and first arguments were streamed before the cut: the whole
reply keeps their text as content (so does the stream's last delta)."""


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_call_fragments_add_up_to_the_whole_calls(tok: ChatTokenizer, family: str) -> None:
    """The chat stream's call fragments, in random chunkings: each call's head first,
    its argument fragments concatenating byte for byte to the whole parse's arguments,
    the content equal to the whole parse's; JSON-argument formats stream the arguments
    in several pieces when tokens come one at a time."""
    tok = ChatTokenizer(tok.core, output_parser=parser_for(family))
    rng = random.Random(family)
    for case in FAMILIES[family]:
        whole = tok.output_parser.parse(case.text, parse_tools=True, id_seed=SEED, tools=TOOLS)
        expected = [(c.id, c.name, c.arguments) for c in whole.tool_calls]
        budget = 4 * len(case.text) + 8
        for steps in [[1] * budget] + [
            [rng.randint(1, 7) for _ in range(budget)] for _ in range(6)
        ]:
            content, _, calls, pieces = stream_call_fragments(tok, case.text, steps)
            assert content == whole.content, case.name
            if (family, case.name) in PARTIAL_CALL_STREAMED:
                # (none when the cut comes in the step that starts the arguments)
                assert len(calls) <= 1, case.name
                assert not expected and all(c[2].startswith("{") for c in calls), case.name
                continue
            assert calls == expected, case.name
            if steps[0] == 1 and family in STREAMED_ARGUMENTS and expected:
                assert min(pieces) > 1, (case.name, pieces)


def test_special_token_markers_survive_the_decode(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Mistral's `[TOOL_CALLS]` and `[ARGS]` are special tokens: a Mistral model's replies
    are decoded keeping them (whole and streamed), other models' still drop specials."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    hf.save_pretrained(tmp_path / "mistral")
    (tmp_path / "mistral" / "chat_template.jinja").write_text(MISTRAL_TOOLS_TEMPLATE)
    tok = ChatTokenizer.from_pretrained(tmp_path / "mistral")
    assert tok.output_parser.name == "mistral+none"
    text = 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Köln"}'
    ids = tok.encode(text)
    assert hf.convert_tokens_to_ids("[TOOL_CALLS]") in ids
    assert tok.decode(ids) == text
    rng = random.Random(0)
    stream = ChoiceStream(tok, completion_id="chatcmpl-t", parse_tools=True, tools=TOOLS)
    content, calls, pos = "", [], 0
    while pos < len(ids):
        step = rng.randint(1, 3)
        delta = stream.push(
            ids[pos : pos + step],
            [0.0] * len(ids[pos : pos + step]),
            FinishReason("length", length=len(ids)) if pos + step >= len(ids) else None,
        )
        content, calls, pos = content + delta.content, calls + list(delta.tool_calls), pos + step
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Köln"}')]
    hermes = ChatTokenizer.from_pretrained(tmp_path / "mistral", tool_parser="hermes")
    assert hermes.decode(ids) == text.replace("[TOOL_CALLS]", "").replace("[ARGS]", "")


# ---------------------------------------------------------------- reverse direction

REPLAY = {
    "qwen3_coder": (
        QWEN3_CODER_TEMPLATE,
        "<|im_end|>",
        (
            "one_call",
            "content_then_call",
            "two_calls",
            "multiline_value",
            "untyped_string_like_number",
        ),
    ),
    "llama3_json": (LLAMA31_TEMPLATE, "<|eot_id|>", ("one_call", "plain")),
    "deepseek_v3": (
        DEEPSEEK_V3_TEMPLATE,
        "<|im_end|>",
        ("plain", "one_call", "content_then_call", "two_calls"),
    ),
    "kimi_k2": (
        KIMI_K2_TEMPLATE,
        "<|im_end|>",
        ("plain", "one_call", "content_then_call", "two_calls"),
    ),
    "mistral": (
        MISTRAL_TOOLS_TEMPLATE,
        "<|im_end|>",
        ("plain", "one_call", "content_then_call", "two_calls", "compact_json"),
    ),
}
"""Family -> (template, its end of turn, cases whose replay must render back exactly).
Llama 3.1's template writes arguments with `tojson` (`", "`, `": "` separators) and one
call per turn, so only replies written that way replay exactly."""


@pytest.mark.parametrize("family", sorted(REPLAY))
def test_replayed_reply_renders_back_to_the_generated_text(
    tiny_model_dir: Path, tmp_path: Path, family: str
) -> None:
    template, end, names = REPLAY[family]
    tok = ChatTokenizer.from_pretrained(
        tokenizer_dir_with_template(tiny_model_dir, tmp_path / family, template)
    )
    assert tok.output_parser.tools.name == family  # chosen from the template
    user = [{"role": "user", "content": "Weather in Paris?"}]
    cases = {c.name: c for c in FAMILIES[family]}
    for name in names:
        text = cases[name].text
        parsed = tok.output_parser.parse(text, parse_tools=True, id_seed=SEED, tools=TOOLS)
        message = {
            "role": "assistant",
            "content": parsed.content or "",
            "tool_calls": [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in parsed.tool_calls
            ],
        }
        if not parsed.tool_calls:
            del message["tool_calls"]
        prompt = tok.render(user, TOOLS)
        history = tok.render([*user, message], TOOLS, add_generation_prompt=False)
        assert history.startswith(prompt), name
        assert history[len(prompt) :].startswith(text + end), (name, history[len(prompt) :])
