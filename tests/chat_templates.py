"""Real checkpoints' chat templates and a tool round, shared by the chat-template tests
(importable from tests/unit and tests/integration alike: pytest puts tests/ on sys.path
for its conftest)."""

from __future__ import annotations

import shutil
from pathlib import Path

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
"""SmolLM2-135M-Instruct's `chat_template.jinja`, verbatim."""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

TOOL_ROUND = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
"""A tool round as OpenAI clients send it back: the assistant turn's content is null."""


def tokenizer_dir_with_template(src: Path, dst: Path, template: str) -> Path:
    """The tokenizer files of checkpoint `src` in `dst`, with `template` as the
    checkpoint's own chat template."""
    dst.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, dst / name)
    (dst / "chat_template.jinja").write_text(template)
    return dst
