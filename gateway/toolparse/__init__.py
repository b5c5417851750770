"""Tool-call and reasoning parsers, one module per model family, and the registry that
picks one per served model (`registry.select_parser`). `parse_output` is the default
parser (Hermes `<tool_call>` JSON + a leading `<think>` block), the one a tokenizer built
without a model directory uses."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.toolparse.base import (
    OutputParser,
    ParsedText,
    ReasoningFormat,
    ToolCall,
    ToolFormat,
    held_suffix,
    tool_call_id,
)
from gateway.toolparse.hermes import TOOL_CLOSE, TOOL_OPEN, HermesToolFormat
from gateway.toolparse.think import THINK_CLOSE, THINK_OPEN, ThinkReasoning

__all__ = [
    "THINK_CLOSE",
    "THINK_OPEN",
    "TOOL_CLOSE",
    "TOOL_OPEN",
    "OutputParser",
    "ParsedText",
    "ReasoningFormat",
    "ToolCall",
    "ToolFormat",
    "default_parser",
    "held_suffix",
    "parse_output",
    "tool_call_id",
]


def default_parser() -> OutputParser:
    """Hermes tool calls and `<think>` reasoning: what the gateway parsed before parsers
    were chosen per model, and still the fallback for an unrecognized template."""
    return OutputParser(ThinkReasoning(), HermesToolFormat())


def parse_output(
    text: str,
    *,
    parse_tools: bool,
    id_seed: str,
    final: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> ParsedText:
    """`default_parser().parse(...)`: split generated text into reasoning, content and
    Hermes tool calls (`final=False`: `text` is a prefix; see `toolparse.base`)."""
    return default_parser().parse(
        text, parse_tools=parse_tools, id_seed=id_seed, final=final, tools=tools
    )
