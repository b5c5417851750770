"""A real checkpoint's own chat template in the gateway's tokenizer: SmolLM2-135M-Instruct's
ChatML template (renders no tools, reads `message['content']` unguarded), on the tiny
model's tokenizer files. Covers: a template failure becomes `ChatTemplateError` (the 400),
an assistant turn with only tool calls renders (content "" as vLLM sends it), the
`renders_tools` probe and its start-up warning, and `engine.chat_template` (a file, or
`builtin:chatml-tools`) replacing the checkpoint's template on both loaders."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from support.chat_templates import SMOLLM2_TEMPLATE, TOOL_ROUND, TOOLS, tokenizer_dir_with_template
from transformers import AutoTokenizer

from areal_service.config import load_config
from engine.tiny_model import chat_template as tiny_chat_template
from gateway.chat_template import template_setting_text
from gateway.tokenizer import (
    ChatTemplateError,
    ChatTokenizer,
    TransformersTokenizer,
)
from gateway.translate import normalize_messages, render_prompt_ids


@pytest.fixture(scope="module")
def smol_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_dir_with_template(
        tiny_model_dir, tmp_path_factory.mktemp("smol") / "ckpt", SMOLLM2_TEMPLATE
    )


@pytest.fixture(scope="module")
def smol(smol_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(smol_dir)


# ---------------------------------------------------------------- template failures


def test_template_failure_is_a_chat_template_error(smol: ChatTokenizer, smol_dir: Path) -> None:
    """Raw messages with `content: None`: the template reads an undefined field, as it
    does under transformers (which drops None keys too); the gateway's error is a 400
    naming the template's own words."""
    hf = AutoTokenizer.from_pretrained(smol_dir)
    with pytest.raises(Exception, match="has no attribute 'content'"):
        hf.apply_chat_template(TOOL_ROUND, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ChatTemplateError) as failed:
        smol.render(TOOL_ROUND, None)
    error = failed.value
    assert error.message == (
        "the model's chat template cannot render this conversation: "
        "UndefinedError: 'dict object' has no attribute 'content'"
    )
    assert error.code == "chat_template_error"
    assert type(error.__cause__).__name__ == "UndefinedError"


def test_tool_call_turn_without_content_renders(smol: ChatTokenizer, smol_dir: Path) -> None:
    """The gateway normalises a missing content to "" (vLLM's rendering), so the
    conversation renders; the text is transformers' for the same normalised messages."""
    normalized = normalize_messages(TOOL_ROUND)
    assert normalized[1]["content"] == ""
    hf = AutoTokenizer.from_pretrained(smol_dir)
    expected = hf.apply_chat_template(normalized, tokenize=False, add_generation_prompt=True)
    text = smol.render(normalized, None)
    assert text == expected
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\nsunny<|im_end|>" in text
    assert render_prompt_ids(smol, TOOL_ROUND, None, None) == smol.encode(text)
    # As the request model hands them over: None fields already dropped (no key at all).
    dropped = [{k: v for k, v in m.items() if v is not None} for m in TOOL_ROUND]
    assert render_prompt_ids(smol, dropped, None, None) == smol.encode(text)


def test_normalised_empty_content_renders_as_none_in_the_project_template(
    tok: ChatTokenizer,
) -> None:
    """Templates that test the content render "" as they rendered no content: the
    project's own template gives the same text (token continuity's re-renders agree)."""
    messages = normalize_messages(TOOL_ROUND)
    as_none = [{**m, "content": None} if m["role"] == "assistant" else m for m in messages]
    assert tok.render(messages, TOOLS) == tok.render(as_none, TOOLS)


# ---------------------------------------------------------------- tools support


def test_renders_tools_probe(smol: ChatTokenizer, tok: ChatTokenizer) -> None:
    assert smol.renders_tools is False
    assert smol.render([{"role": "user", "content": "hi"}], TOOLS) == smol.render(
        [{"role": "user", "content": "hi"}], None
    )  # tools silently dropped by the template
    assert tok.renders_tools is True  # the tiny model's template: engine/chat_template.jinja


def test_template_that_cannot_render_a_tool_call_renders_no_tools() -> None:
    """A template that raises on the probe counts as not rendering tools."""
    from gateway.chat_template import ChatTemplate

    class Core:
        added_tokens: dict[int, str] = {}
        byte_level = False

        def __init__(self) -> None:
            self._template = ChatTemplate(
                "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                {},
            )

        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

        def encode_batch(self, texts: list[str]) -> list[list[int]]:
            return [self.encode(t) for t in texts]

        def decode(self, ids: list[int]) -> str:
            return "".join(map(chr, ids))

        def id_to_piece(self, token_id: int) -> str | None:
            return chr(token_id)

        def render(
            self, messages: list[dict[str, Any]], tools: Any, *, add_generation_prompt: bool = True
        ) -> str:
            return self._template.render(
                messages, tools, add_generation_prompt=add_generation_prompt
            )

    tokenizer = ChatTokenizer(Core())
    assert tokenizer.renders_tools is False
    with pytest.raises(ChatTemplateError, match="TemplateError: no tools here"):
        tokenizer.render([{"role": "user", "content": "x"}], TOOLS)


def test_startup_warning_names_the_model_and_the_setting(
    smol_dir: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.tokenizer"):
        ChatTokenizer.from_pretrained(smol_dir)
    (record,) = [r for r in caplog.records if r.name == "gateway.tokenizer"]
    message = record.getMessage()
    assert str(smol_dir) in message
    assert "will not reach the model" in message
    assert "engine.chat_template" in message and "builtin:chatml-tools" in message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gateway.tokenizer"):
        ChatTokenizer.from_pretrained(smol_dir, chat_template="builtin:chatml-tools")
        ChatTokenizer.from_pretrained(tiny_model_dir)
    assert not [r for r in caplog.records if r.name == "gateway.tokenizer"]


# ---------------------------------------------------------------- engine.chat_template


def test_builtin_chatml_tools_is_the_engine_template() -> None:
    assert template_setting_text("builtin:chatml-tools") == tiny_chat_template()


def test_builtin_template_replaces_the_checkpoints(smol_dir: Path, tok: ChatTokenizer) -> None:
    """SmolLM2 with `builtin:chatml-tools` renders tools and tool calls exactly as the
    tiny model (whose own template is that file) does."""
    served = ChatTokenizer.from_pretrained(smol_dir, chat_template="builtin:chatml-tools")
    assert served.renders_tools is True
    messages = normalize_messages(TOOL_ROUND)
    text = served.render(messages, TOOLS)
    assert text == tok.render(messages, TOOLS)
    assert '"name": "get_weather"' in text and "<tool_call>" in text


def test_template_file_setting(smol_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "mine.jinja"
    path.write_text(
        "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
        "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}"
        "{% endif %}"
    )
    served = ChatTokenizer.from_pretrained(smol_dir, chat_template=str(path))
    assert served.render([{"role": "user", "content": "hi"}], TOOLS) == "[user:hi]TOOLS get_weather"
    assert served.renders_tools is True


def test_bad_template_settings_name_the_setting(smol_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"engine.chat_template: unknown built-in template "
        r"'builtin:nope' \(known: builtin:chatml-tools",
    ):
        ChatTokenizer.from_pretrained(smol_dir, chat_template="builtin:nope")
    missing = tmp_path / "absent.jinja"
    with pytest.raises(ValueError, match="engine.chat_template: cannot read the template file"):
        ChatTokenizer.from_pretrained(smol_dir, chat_template=str(missing))


def test_setting_replaces_the_template_of_a_transformers_loaded_tokenizer(
    smol_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint this loader hands to transformers (a model-specific class) gets the
    setting's template too."""
    ckpt = tmp_path / "gpt2"
    shutil.copytree(smol_dir, ckpt)
    for name, changes in (
        ("config.json", {"model_type": "gpt2"}),
        ("tokenizer_config.json", {"tokenizer_class": "GPT2Tokenizer"}),
    ):
        data = json.loads((ckpt / name).read_text())
        data.update(changes)
        (ckpt / name).write_text(json.dumps(data))
    own = ChatTokenizer.from_pretrained(ckpt)
    served = ChatTokenizer.from_pretrained(ckpt, chat_template="builtin:chatml-tools")
    assert isinstance(served.core, TransformersTokenizer)
    assert own.renders_tools is False and served.renders_tools is True
    assert served.hf.chat_template == tiny_chat_template()


def test_config_accepts_the_setting(tmp_path: Path) -> None:
    config = load_config(
        overrides=[f"data_dir={tmp_path}", "engine.chat_template=builtin:chatml-tools"]
    )
    assert config.engine.chat_template == "builtin:chatml-tools"
    assert load_config(overrides=[f"data_dir={tmp_path}"]).engine.chat_template is None
