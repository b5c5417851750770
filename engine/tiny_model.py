"""Builds the project's own tiny checkpoint: a real Qwen2 causal LM and a byte-level BPE
tokenizer trained here on generated text, saved with `save_pretrained`.

The result loads with `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained(dir)`
exactly like a downloaded checkpoint, so every code path that serves or trains it
serves or trains a real model unchanged. Deterministic for a seed. No network.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from areal_service.atomic import atomic_dir

# Special tokens in Qwen's layout: ChatML delimiters are special (stripped by
# skip_special_tokens); tool/think markers are plain added tokens, so they survive
# decoding and the gateway's parsers see them, as with Qwen checkpoints.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKER_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<tool_response>",
    "</tool_response>",
]


class TinyModelSpec(BaseModel):
    """Shape of the tiny model. Defaults give about 0.9 M parameters."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    corpus_lines: int = 4000


def chat_template() -> str:
    """The ChatML + `<tool_call>` template shipped with the package."""
    return resources.files("engine").joinpath("chat_template.jinja").read_text()


_WORDS = (
    "the a model agent tool call answer question result value number add sum weather "
    "city search file read write list json name arguments think step first then so is "
    "what how many apples has gives total left right yes no hello world please thanks"
).split()
_TOOLS = ["add", "multiply", "get_weather", "search", "read_file", "lookup"]


def _corpus(rng: random.Random, lines: int) -> Iterator[str]:
    """Generated training text for the BPE merges: prose, arithmetic, JSON tool calls."""
    for i in range(lines):
        kind = i % 4
        if kind == 0:
            yield " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))) + "."
        elif kind == 1:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            yield f"What is {a} + {b}? {a} + {b} = {a + b}. The answer is {a + b}."
        elif kind == 2:
            args = {"a": rng.randint(0, 50), "b": rng.randint(0, 50)}
            call = {"name": rng.choice(_TOOLS), "arguments": args}
            yield f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        else:
            yield f"<think>\n{rng.choice(_WORDS)} {rng.choice(_WORDS)}\n</think>\n\n{rng.choice(_WORDS)}"


def build_tokenizer(spec: TinyModelSpec):  # noqa: ANN201 - transformers type, lazily imported
    """Train a byte-level BPE on generated text and wrap it as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AddedToken, PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(MARKER_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus(random.Random(spec.seed), spec.corpus_lines), trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=spec.max_position_embeddings,
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    tok.chat_template = chat_template()
    return tok


def build_model(spec: TinyModelSpec, vocab_size: int, eos_id: int, pad_id: int):  # noqa: ANN201
    """A randomly initialised Qwen2ForCausalLM (deterministic for `spec.seed`)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        # The spec's shape fields are named as Qwen2Config names them.
        **spec.model_dump(exclude={"seed", "vocab_size", "corpus_lines"}),
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id)
    return model


def make_tiny_model(out_dir: Path | str, spec: TinyModelSpec | None = None) -> Path:
    """Build tokenizer + model and save both to `out_dir` atomically (temp dir, rename)."""
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    tok = build_tokenizer(spec)
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    model = build_model(spec, len(tok), eos_id, pad_id)
    with atomic_dir(out) as tmp, _no_progress_bars():
        tok.save_pretrained(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
    return out


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' "Writing model shards" bar off while saving: the model is built
    inside commands (`demo`, `serve`) whose own lines it would break up."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def ensure_tiny_model(out_dir: Path | str, spec: TinyModelSpec | None = None) -> Path:
    """Reuse a built tiny model when its files are present, else build it."""
    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    return make_tiny_model(out, spec)
