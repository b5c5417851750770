"""Which output parser a served model gets: chosen once, at start-up, from its chat
template (the markers it renders a tool call and reasoning with), else its `config.json`
architecture; the `gateway.tool_parser` / `gateway.reasoning_parser` settings override
the choice. A template that renders tool calls in a format no parser here reads is logged
once: its tool calls come back as text.

Formats recognized but not parsed yet are listed in `NOT_SUPPORTED`, so the warning can
name the family.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.toolparse.base import OutputParser, ReasoningFormat, ToolFormat
from gateway.toolparse.glm import GlmToolFormat
from gateway.toolparse.harmony import GptOssToolFormat, HarmonyReasoning
from gateway.toolparse.hermes import HermesToolFormat
from gateway.toolparse.llama3 import Llama3JsonToolFormat
from gateway.toolparse.mistral import MistralToolFormat
from gateway.toolparse.pythonic import PythonicToolFormat
from gateway.toolparse.qwen3_coder import Qwen3CoderToolFormat
from gateway.toolparse.sections import (
    DeepSeekV3ToolFormat,
    DeepSeekV31ToolFormat,
    KimiK2ToolFormat,
)
from gateway.toolparse.think import (
    THINK_OPEN,
    GlmThink,
    MistralThink,
    PromptOpenedThink,
    ThinkReasoning,
)

log = logging.getLogger(__name__)

TOOL_FORMATS: dict[str, type[ToolFormat]] = {
    "hermes": HermesToolFormat,
    "qwen3_coder": Qwen3CoderToolFormat,
    "llama3_json": Llama3JsonToolFormat,
    "mistral": MistralToolFormat,
    "deepseek_v3": DeepSeekV3ToolFormat,
    "deepseek_v31": DeepSeekV31ToolFormat,
    "kimi_k2": KimiK2ToolFormat,
    "llama4_pythonic": PythonicToolFormat,
    "glm45": GlmToolFormat,
    "gpt_oss": GptOssToolFormat,
    "none": ToolFormat,
}
"""`gateway.tool_parser` values (vLLM's names where vLLM has the same format)."""
REASONING_FORMATS: dict[str, type[ReasoningFormat]] = {
    "think": ThinkReasoning,
    "harmony": HarmonyReasoning,
    "mistral": MistralThink,
    "glm": GlmThink,
    "none": ReasoningFormat,
}
"""`gateway.reasoning_parser` values."""

_TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Most specific first: Qwen3-Coder's XML and GLM's tags sit inside the same
    # <tool_call> as Hermes.
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("glm45", ("<arg_key>",)),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ('"parameters": ', "<|start_header_id|>")),
    ("llama3_json", ('"parameters": ', "<|header_start|>")),  # Llama 4's JSON calls
    ("mistral", ("[TOOL_CALLS]",)),
    ("deepseek_v3", ("<｜tool▁calls▁begin｜>", "```json")),
    ("deepseek_v31", ("<｜tool▁calls▁begin｜>",)),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("llama4_pythonic", ("<|python_start|>",)),
    # vLLM's Llama 4 pythonic template writes no <|python_start|>: its instruction names
    # the call-list format.
    ("llama4_pythonic", ("<|header_start|>", "[func_name1(")),
    ("gpt_oss", ("<|channel|>",)),
)
"""(tool format, strings its chat template contains, all of them)."""
NOT_SUPPORTED: tuple[tuple[str, str], ...] = (
    ("MiniMax M2", "<minimax:tool_call>"),
    ("Seed-OSS", "<seed:tool_call>"),
    ("Granite", "<|tool_call|>"),
)
"""(family, a string its template contains) of formats recognized but not parsed."""
_ARCHITECTURES = {
    "Qwen2ForCausalLM": "hermes",
    "Qwen2MoeForCausalLM": "hermes",
    "Qwen3ForCausalLM": "hermes",
    "Qwen3MoeForCausalLM": "hermes",
}
"""Fallback by `config.json` `architectures[0]` when the template names no format. Only
architectures one family uses: `LlamaForCausalLM` also serves SmolLM2, Llama 2 and
distilled models that write other formats, so a Llama 3 checkpoint is recognized by its
template (or set `gateway.tool_parser=llama3_json`)."""
_FAMILY_REASONING = {
    "llama3_json": "none",
    "mistral": "none",
    "llama4_pythonic": "none",
    "gpt_oss": "harmony",
    "glm45": "glm",
}
"""Reasoning of the families that write no `<think>` block (the default is `think`: a
leading `<think>` block, as the gateway has always parsed); Mistral's is `mistral`
(Magistral's `[THINK]` block) where the template writes `[THINK]`; GLM's is its
newline-framed block (`glm`)."""


@dataclass(frozen=True, slots=True)
class Selection:
    parser: OutputParser
    reason: str
    """How it was chosen (logged once at start-up)."""


def select_parser(
    template: str | Mapping[str, str] | None,
    model_config: Mapping[str, Any],
    *,
    renders_tools: bool = True,
    generation_prompt: str = "",
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
    source: str = "the model",
) -> Selection:
    """The parser for a model whose chat template text is `template` (named templates:
    all of them) and whose `config.json` is `model_config`. `tool_parser` /
    `reasoning_parser`: the settings' overrides (validated by the config). Logs one
    warning when the template renders tools (`renders_tools`) and its tool calls in a
    format not parsed here, unless `tool_parser` names one. `generation_prompt`: the end
    of a rendered prompt; when it opens `<think>`, replies start inside reasoning."""
    text = "\n".join(template.values()) if isinstance(template, Mapping) else template or ""
    if tool_parser is not None:
        tool_name, reason = tool_parser, "gateway.tool_parser"
    else:
        tool_name, reason = _tool_format(text, model_config, source, renders_tools)
    reasoning_name = _FAMILY_REASONING.get(tool_name, "think")
    if tool_name == "mistral" and "[THINK]" in text:
        reasoning_name = "mistral"
    if reasoning_parser is not None:
        reasoning_name, reason = reasoning_parser, f"{reason}; gateway.reasoning_parser"
    reasoning = REASONING_FORMATS[reasoning_name]()
    if reasoning_name == "think" and generation_prompt.rstrip().endswith(THINK_OPEN):
        reasoning = PromptOpenedThink()
    parser = OutputParser(reasoning, TOOL_FORMATS[tool_name]())
    return Selection(parser, reason)


def _tool_format(
    text: str, model_config: Mapping[str, Any], source: str, renders_tools: bool
) -> tuple[str, str]:
    for name, markers in _TEMPLATE_MARKERS:
        if all(m in text for m in markers):
            return name, "chat template"
    unknown = next((family for family, marker in NOT_SUPPORTED if marker in text), None)
    architectures = model_config.get("architectures") or [None]
    by_arch = _ARCHITECTURES.get(architectures[0]) if unknown is None else None
    if by_arch is not None:
        return by_arch, f"config.json architecture {architectures[0]}"
    if renders_tools:
        log.warning(
            "%s renders tool calls in a format this gateway does not parse%s: its tool "
            "calls will come back as text (the Hermes <tool_call> format is still read). "
            "Set gateway.tool_parser to one of %s if the model writes one of those",
            source,
            f" ({unknown})" if unknown else "",
            ", ".join(sorted(TOOL_FORMATS)),
        )
    return "hermes", "default (format not recognized)"
