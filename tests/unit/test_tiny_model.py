"""The tiny model is a real HF checkpoint: loads with Auto*, renders tools, deterministic."""

from __future__ import annotations

import hashlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.tiny_model import TinyModelSpec, make_tiny_model


def _digest(path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.is_file()
    }


def test_loads_like_a_downloaded_checkpoint(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    assert 200_000 <= n_params <= 5_000_000
    assert model.config.model_type == "qwen2"
    ids = tok.encode("What is 2 + 3?", add_special_tokens=False)
    assert tok.decode(ids) == "What is 2 + 3?"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)


def test_chat_template_renders_every_role_and_tools(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 2 and 3."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two numbers",
                "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
            },
        }
    ]
    text = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "add"' in text
    assert (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
        in text
    )
    assert "<tool_response>\n5\n</tool_response>" in text
    assert "<|im_start|>user\nThanks<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert "# Tools" not in plain and not plain.endswith("assistant\n")
    # Markers are single tokens that survive decoding; ChatML delimiters are special.
    ids = tok.encode("<tool_call>x</tool_call><|im_end|>", add_special_tokens=False)
    assert len(ids) == 4
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"


def test_deterministic_for_a_seed(tmp_path):
    spec = TinyModelSpec(seed=3, corpus_lines=400)
    a = _digest(make_tiny_model(tmp_path / "a", spec))
    b = _digest(make_tiny_model(tmp_path / "b", spec))
    c = _digest(make_tiny_model(tmp_path / "c", TinyModelSpec(seed=4, corpus_lines=400)))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
