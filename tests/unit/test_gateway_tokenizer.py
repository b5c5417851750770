"""The torch-free tokenizer loader (`gateway.tokenizer`, `gateway.chat_template`) against
transformers' `AutoTokenizer` on the same checkpoint directories: the backend it builds,
rendered chat templates, encode, decode and token info must be identical. Checkpoint
variants are the tiny model's files rewritten into other real-world layouts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
from transformers import AutoTokenizer

from gateway.chat_template import ChatTemplate, RenderMemo, load_chat_template
from gateway.tokenizer import (
    ChatTemplateError,
    ChatTokenizer,
    RustTokenizer,
    TransformersTokenizer,
)
from gateway.tokenizer_mirror import (
    GENERIC_CLASSES,
    NAMED_SPECIAL_TOKENS,
    auto_tokenizer_class,
    transformers_reason,
)

REPO = Path(__file__).parents[2]

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
"""Qwen2.5-Instruct's template (indented blocks: exercises trim_blocks/lstrip_blocks)."""

FEATURE_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(system='', turns=0) %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- endif %}
{%- set meta = dict(year=strftime_now('%Y') | length, tools=(tools | length if tools else 0)) %}
<|start_header_id|>system<|end_header_id|>

{{ ns.system }}
{%- if tools %}

{{ tools | tojson(indent=2) }}
{%- endif %}
{{ meta | tojson(sort_keys=true) }} {{ image_token }}<|eot_id|>
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role ' + message['role']) }}
    {%- endif %}
    {%- if message['content'] == 'STOP' %}{% break %}{% endif %}
    {%- if message['content'] == 'SKIP' %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message.tool_calls is defined %}
        {%- for call in message.tool_calls %}{{ call.function | tojson(separators=(',', ':')) }}{% endfor %}
    {%- elif message['content'] is string %}
        {%- generation %}{{ message['content'] | trim }}{% endgeneration %}
    {%- else %}
        {%- for part in message['content'] %}{{ part['text'] }}{% endfor %}
    {%- endif %}
    {%- if message.thinking is defined %}[{{ message.thinking }}]{% endif %}
    {{- eos_token }}
{%- endfor %}
{{- ns.turns }}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}
"""
"""Everything transformers' environment adds: bos/eos/model-specific token variables,
namespace, dict, strftime_now, tojson arguments, loop controls, `{% generation %}`."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers – exactly.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Wetter für eine Stadt 🌦",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Zürich", "東京"]}},
            },
        },
    },
]

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
}
CALL_UNICODE = {
    "id": "call_2",
    "type": "function",
    "function": {
        "name": "get_weather",
        "arguments": '{"city": "東京", "note": "naïve \\"quoted\\""}',
    },
}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "single_user": [{"role": "user", "content": "Hello"}],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5."},
        {"role": "user", "content": "And 40 + 2?"},
    ],
    "content_parts": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "part one"},
                {"type": "text", "text": "part two 🙂"},
            ],
        }
    ],
    "tool_round_trip": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Please add 2 and 3."},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "assistant", "content": "The answer is 5."},
        {"role": "user", "content": "Weather in Tokyo?"},
    ],
    "parallel_calls": [
        {"role": "user", "content": "Both, please."},
        {"role": "assistant", "content": "Calling both.", "tool_calls": [CALL, CALL_UNICODE]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 21.5}'},
    ],
    "unicode": [
        {"role": "user", "content": "Ünïcödé: café / cafe\u0301 東京 👨‍👩‍👧 ｆｕｌｌ مرحبا"},
        {"role": "assistant", "content": "12345678 + 0.25 = ?\t\n  \n\n"},
        {"role": "user", "content": "   leading and trailing   "},
    ],
    "empty_content": [
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "ok"},
    ],
    "reasoning": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "4", "reasoning_content": "2 + 2 is 4"},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "6", "reasoning": "3 + 3"},
        {"role": "user", "content": "<think>literal markers</think> and <|im_end|> inside"},
    ],
}


# ---------------------------------------------------------------- checkpoint variants


def _copy_tokenizer_files(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2))


def _added_tokens_decoder(src: Path) -> dict[str, dict[str, Any]]:
    """tokenizer.json's added tokens in transformers 4's tokenizer_config layout."""
    added = json.loads((src / "tokenizer.json").read_text())["added_tokens"]
    return {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}


def make_qwen25_layout(src: Path, dst: Path) -> Path:
    """A transformers-4-saved Qwen2.5 checkpoint: template and added tokens in
    tokenizer_config.json, `additional_special_tokens`, null bos/unk, Qwen2Tokenizer; two
    added tokens' flags differ from tokenizer.json's (the config's win, then Qwen2Tokenizer
    re-adds every special token as special)."""
    _copy_tokenizer_files(src, dst)
    (dst / "chat_template.jinja").unlink()
    added = _added_tokens_decoder(src)
    added["651"]["special"] = True  # </tool_response>
    added["1"]["special"] = False  # <|im_start|>
    (dst / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_prefix_space": False,
                "added_tokens_decoder": added,
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                "bos_token": None,
                "chat_template": QWEN25_TEMPLATE,
                "clean_up_tokenization_spaces": False,
                "eos_token": "<|im_end|>",
                "errors": "replace",
                "model_max_length": 131072,
                "pad_token": "<|endoftext|>",
                "split_special_tokens": False,
                "tokenizer_class": "Qwen2Tokenizer",
                "unk_token": None,
            },
            indent=2,
        )
    )
    return dst


def make_generic_layout(src: Path, dst: Path, tokenizer_class: str) -> Path:
    """A Llama-3-style checkpoint: byte-level tokenizer.json served as saved (model type
    llama), bos/eos and a model-specific `image_token` for the template."""
    _copy_tokenizer_files(src, dst)
    (dst / "chat_template.jinja").write_text(FEATURE_TEMPLATE)
    _edit_json(dst / "config.json", model_type="llama", architectures=["LlamaForCausalLM"])
    _edit_json(
        dst / "tokenizer_config.json",
        tokenizer_class=tokenizer_class,
        bos_token="<|endoftext|>",
        image_token="<tool_response>",
        clean_up_tokenization_spaces=True,
    )
    return dst


def make_named_templates_layout(src: Path, dst: Path) -> Path:
    """Templates as a list of {name, template} in tokenizer_config.json: `tool_use` is
    picked when tools are given, `default` otherwise."""
    _copy_tokenizer_files(src, dst)
    tool_use = (dst / "chat_template.jinja").read_text()
    (dst / "chat_template.jinja").unlink()
    _edit_json(
        dst / "tokenizer_config.json",
        chat_template=[
            {"name": "default", "template": QWEN25_TEMPLATE},
            {"name": "tool_use", "template": "TOOLS {{ tools | length }} " + tool_use},
        ],
    )
    return dst


@pytest.fixture(scope="module")
def variants(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizer_variants")
    return {
        "tiny": tiny_model_dir,
        "qwen25_v4": make_qwen25_layout(tiny_model_dir, root / "qwen25"),
        "llama3_generic": make_generic_layout(
            tiny_model_dir, root / "llama3", "PreTrainedTokenizerFast"
        ),
        "llama_named_bytelevel": make_generic_layout(
            tiny_model_dir, root / "llama_bl", "LlamaTokenizerFast"
        ),
        "named_templates": make_named_templates_layout(tiny_model_dir, root / "named"),
    }


@pytest.fixture(scope="module")
def pairs(variants: dict[str, Path]) -> dict[str, tuple[ChatTokenizer, Any]]:
    return {
        name: (ChatTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path))
        for name, path in variants.items()
    }


VARIANTS = ["tiny", "qwen25_v4", "llama3_generic", "llama_named_bytelevel", "named_templates"]


# ---------------------------------------------------------------- loading


@pytest.mark.parametrize("name", VARIANTS)
def test_backend_equals_transformers_backend(
    pairs: dict[str, Any], variants: dict[str, Path], name: str
) -> None:
    tok, hf = pairs[name]
    assert isinstance(tok.core, RustTokenizer)
    # The whole serialized Rust tokenizer: pipeline, BPE options, added tokens and flags.
    assert json.loads(tok.core._backend.to_str()) == json.loads(hf.backend_tokenizer.to_str())
    config = json.loads((variants[name] / "tokenizer_config.json").read_text())
    model_config = json.loads((variants[name] / "config.json").read_text())
    resolved = auto_tokenizer_class(variants[name], config, model_config)
    assert resolved == type(hf).__name__ or (
        resolved in GENERIC_CLASSES and type(hf).__name__ == "TokenizersBackend"
    )
    assert tok.core._template._special == hf.special_tokens_map
    assert dict(tok.core.added_tokens) == {i: t.content for i, t in hf.added_tokens_decoder.items()}


def test_tables_match_installed_transformers() -> None:
    from transformers.models.auto import tokenization_auto as auto
    from transformers.models.qwen2 import tokenization_qwen2
    from transformers.models.qwen3_5 import tokenization_qwen3_5
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from gateway.tokenizer_mirror import CLASS_PIPELINES, HUB_CLASS_OVERRIDES

    assert HUB_CLASS_OVERRIDES == {
        m: auto.TOKENIZER_MAPPING_NAMES[m] for m in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    }
    assert CLASS_PIPELINES["Qwen2Tokenizer"].split_regex == tokenization_qwen2.PRETOKENIZE_REGEX
    assert CLASS_PIPELINES["Qwen3_5Tokenizer"].split_regex == tokenization_qwen3_5.PRETOKENIZE_REGEX
    assert list(NAMED_SPECIAL_TOKENS) == PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES


@pytest.mark.processes
def test_module_imports_neither_torch_nor_transformers(tiny_model_dir: Path) -> None:
    code = (
        "import sys, gateway.tokenizer as g\n"
        f"t = g.ChatTokenizer.from_pretrained({str(tiny_model_dir)!r})\n"
        "ids = t.encode(t.render([{'role': 'user', 'content': 'hi'}], None))\n"
        "assert ids and t.decode(ids) == 'user\\nhi\\nassistant\\n', t.decode(ids)\n"
        "assert type(t.core).__name__ == 'RustTokenizer'\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_slow_only_checkpoint_loads_through_transformers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """No tokenizer.json: vocab.json + merges.txt, loaded by transformers, same ids."""
    data = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    (tmp_path / "vocab.json").write_text(json.dumps(data["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    for name in ("config.json", "chat_template.jinja", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    _edit_json(
        tmp_path / "tokenizer_config.json",
        added_tokens_decoder=_added_tokens_decoder(tiny_model_dir),
    )
    tok, reference = (
        ChatTokenizer.from_pretrained(tmp_path),
        ChatTokenizer.from_pretrained(tiny_model_dir),
    )
    assert isinstance(tok.core, TransformersTokenizer)
    conversation = CONVERSATIONS["tool_round_trip"]
    text = tok.render(conversation, TOOLS)
    assert text == reference.render(conversation, TOOLS)
    assert tok.encode(text) == reference.encode(text)


def test_model_specific_class_falls_back_to_transformers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A class whose transformers `__init__` rebuilds a pipeline not reproduced here."""
    _copy_tokenizer_files(tiny_model_dir, tmp_path / "gpt2")
    _edit_json(tmp_path / "gpt2" / "config.json", model_type="gpt2")
    _edit_json(tmp_path / "gpt2" / "tokenizer_config.json", tokenizer_class="GPT2Tokenizer")
    tok = ChatTokenizer.from_pretrained(tmp_path / "gpt2")
    assert isinstance(tok.core, TransformersTokenizer)
    assert type(tok.hf).__name__ == "GPT2Tokenizer"


def test_transformers_reason_names_why(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The start-up check's reading of a checkpoint matches the loader's choice."""
    assert transformers_reason(tiny_model_dir) is None
    gpt2 = _copy_tokenizer_files(tiny_model_dir, tmp_path / "gpt2")
    _edit_json(gpt2 / "tokenizer_config.json", tokenizer_class="GPT2Tokenizer")
    _edit_json(gpt2 / "config.json", model_type="gpt2")
    assert transformers_reason(gpt2) == "tokenizer class GPT2Tokenizer"
    (gpt2 / "tokenizer.json").unlink()
    assert transformers_reason(gpt2) == "no tokenizer.json"


def test_rust_tokenizer_has_no_hf(pairs: dict[str, Any]) -> None:
    with pytest.raises(AttributeError):
        _ = pairs["tiny"][0].hf


# ---------------------------------------------------------------- rendering


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", VARIANTS)
def test_render_and_encode_equal_transformers(
    pairs: dict[str, Any], name: str, conversation: str, tools: Any
) -> None:
    tok, hf = pairs[name]
    messages = CONVERSATIONS[conversation]
    try:
        rendered = hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
    except TypeError:  # Qwen2.5's template concatenates content parts as a string
        with pytest.raises(TypeError):
            tok.core.render(messages, tools)
        with pytest.raises(ChatTemplateError) as failed:  # the gateway's 400
            tok.render(messages, tools)
        assert isinstance(failed.value.__cause__, TypeError)
        return
    text = tok.render(messages, tools)
    assert text == rendered
    expected = hf.encode(text, add_special_tokens=False)
    assert tok.encode(text) == expected  # segment cache
    assert tok.encode(text) == expected  # served from the cache
    assert tok.core.encode(text) == expected
    assert tok.decode(expected) == hf.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("name", VARIANTS)
def test_memoized_renders_equal_transformers(pairs: dict[str, Any], name: str) -> None:
    """A render repeated with equal inputs comes from the memo, and is still exactly
    transformers' text, with and without tools and the generation prompt."""
    tok, hf = pairs[name]
    template = tok.core._template
    if template._memo is None:
        pytest.skip("this template reads the clock: never memoized")
    for _ in range(2):
        for messages in CONVERSATIONS.values():
            for tools in (None, TOOLS):
                for add in (True, False):
                    try:
                        rendered = hf.apply_chat_template(
                            messages, tools=tools, add_generation_prompt=add, tokenize=False
                        )
                    except TypeError:
                        continue
                    assert tok.render(messages, tools, add_generation_prompt=add) == rendered
                    before = template.memo_hits
                    again = tok.render(
                        [dict(m) for m in messages], tools, add_generation_prompt=add
                    )
                    assert again == rendered
                    assert template.memo_hits == before + 1


def test_memo_keys_keep_types_and_order_apart() -> None:
    """Inputs that differ only in type (1, "1", 1.0, True) or in key order render apart."""
    template = ChatTemplate(
        "{% for m in messages %}{{ m.content|tojson }}"
        "{% for k in m %}{{ k }},{% endfor %};{% endfor %}",
        {},
    )
    for content, shown in [
        (1, "1"),
        ("1", '"1"'),
        (1.0, "1.0"),
        (True, "true"),
        (1, "1"),
        ("1", '"1"'),
    ]:
        assert template.render([{"role": "user", "content": content}], None) == (
            f"{shown}role,content,;"
        )
    assert template.render([{"content": "x", "role": "user"}], None) == '"x"content,role,;'
    assert template.memo_hits == 2


def test_a_template_that_reads_the_clock_is_never_memoized() -> None:
    template = ChatTemplate("{{ strftime_now('%H:%M:%S.%f') }}", {})
    messages = [{"role": "user", "content": "x"}]
    texts = {template.render(messages, None) for _ in range(50)}
    assert len(texts) > 1 and template.memo_hits == 0


def test_render_memo_is_bounded_oldest_out() -> None:
    memo = RenderMemo(max_chars=30, max_entry_chars=20)
    memo.put("a", "x" * 9)
    memo.put("b", "y" * 9)
    memo.put("c", "z" * 9)  # 30 chars: all kept
    assert [memo.get(k) for k in "abc"] == ["x" * 9, "y" * 9, "z" * 9]
    memo.put("d", "w" * 9)  # over: the oldest goes
    assert memo.get("a") is None and memo.get("d") == "w" * 9
    memo.put("e", "v" * 20)  # too large to keep
    assert memo.get("e") is None


def test_named_templates_pick_tool_use_with_tools(pairs: dict[str, Any]) -> None:
    tok, _ = pairs["named_templates"]
    messages = CONVERSATIONS["single_user"]
    assert tok.render(messages, TOOLS).startswith("TOOLS 2<|im_start|>system\n# Tools")
    assert tok.render(messages, None).startswith("<|im_start|>system\nYou are Qwen")
    assert tok.render(messages, []) == tok.render(messages, None)  # no tools offered


def test_template_files_win_over_tokenizer_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    _copy_tokenizer_files(tiny_model_dir, tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt"
    _edit_json(ckpt / "tokenizer_config.json", chat_template="IGNORED {{ messages }}")
    (ckpt / "additional_chat_templates").mkdir()
    (ckpt / "additional_chat_templates" / "tool_use.jinja").write_text("TOOL {{ tools|length }}")
    tok, hf = ChatTokenizer.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt)
    for tools in (None, TOOLS):
        expected = hf.apply_chat_template(
            CONVERSATIONS["multi_turn"], tools=tools, add_generation_prompt=True, tokenize=False
        )
        assert tok.render(CONVERSATIONS["multi_turn"], tools) == expected
    assert tok.render(CONVERSATIONS["multi_turn"], TOOLS) == "TOOL 2"
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert set(load_chat_template(ckpt, config)) == {"default", "tool_use"}


def test_template_errors_like_transformers(pairs: dict[str, Any]) -> None:
    tok, hf = pairs["llama3_generic"]
    bad = [{"role": "narrator", "content": "Once upon a time"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="Unknown role narrator"):
        hf.apply_chat_template(bad, add_generation_prompt=True, tokenize=False)
    with pytest.raises(jinja2.exceptions.TemplateError, match="Unknown role narrator"):
        tok.core.render(bad, None)
    with pytest.raises(ValueError, match="empty conversation"):
        tok.core.render([], None)
    # Through `ChatTokenizer.render`, each is the gateway's 400 with the template's words.
    with pytest.raises(ChatTemplateError, match="Unknown role narrator") as failed:
        tok.render(bad, None)
    assert isinstance(failed.value.__cause__, jinja2.exceptions.TemplateError)
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        tok.render([], None)


def test_loop_controls_and_sandbox(pairs: dict[str, Any]) -> None:
    tok, hf = pairs["llama3_generic"]
    messages = [
        {"role": "user", "content": "SKIP"},
        {"role": "user", "content": "kept"},
        {"role": "user", "content": "STOP"},
        {"role": "user", "content": "dropped"},
    ]
    text = tok.render(messages, None)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "kept" in text and "dropped" not in text
    evil = ChatTemplate("{{ ''.__class__.__mro__ }}", {})
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.render(messages, None)


# ---------------------------------------------------------------- tokens


@pytest.mark.parametrize("name", ["tiny", "qwen25_v4", "llama3_generic"])
def test_every_token_decodes_and_describes_like_transformers(
    pairs: dict[str, Any], name: str
) -> None:
    tok, hf = pairs[name]
    via_hf = ChatTokenizer(hf)
    ids = list(range(len(hf)))
    assert [tok.token_info(i) for i in ids] == [via_hf.token_info(i) for i in ids]
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.think_close_id == via_hf.think_close_id == hf.convert_tokens_to_ids("</think>")
    assert tok._split_at == via_hf._split_at == "<|im_start|>"


def test_plain_template_data() -> None:
    """Inputs are rebuilt as plain data: str subclasses, tuples, pydantic models."""
    from pydantic import BaseModel

    class Part(BaseModel):
        type: str = "text"
        text: str

    class Shout(str):
        def upper(self) -> str:  # would leak if the template saw the subclass
            return "LEAKED"

    template = ChatTemplate(
        "{% for m in messages %}{{ m.content.upper() }}|"
        "{{ m.parts[0].text if m.parts is defined else '' }}|"
        "{{ m.thinking if m.thinking is defined else '' }};{% endfor %}",
        {},
    )
    messages = [
        {"role": "user", "content": Shout("hi"), "parts": (Part(text="p"),)},
        {"role": "assistant", "content": "ok", "reasoning": "r", "tool_calls": None},
    ]
    assert template.render(messages, None) == "HI|p|;OK||r;"
