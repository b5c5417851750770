"""Differential tests: the gateway's tool-call and reasoning parsers against vLLM's own
(`vllm/tool_parsers`, `vllm/reasoning`), on each family's corpus (`tests/support/output_corpus.py`),
whole and streamed in random token chunkings, field by field: vLLM's whole parse against
the gateway's, and each of vLLM's streams (its deltas summed, tool-call argument
fragments concatenated) against the gateway's chat stream of the case in a random
chunking of its own (the same concatenations).

vLLM imports torch, which the gateway's environment must not, so vLLM's parsers run in
vLLM's interpreter (`vllm_parsers_worker.py`, one subprocess for the whole corpus):
AREAL_TEST_VLLM_PYTHON names it (.ci/run sets it); without it these tests skip, unless
AREAL_TEST_REQUIRE_VLLM=1 (CI), which makes that a failure.

Compared after these normalizations, each a difference by design:
- surrounding whitespace of content and reasoning: the gateway drops the newlines the
  family's template puts around a `<think>` block and before a `<tool_call>` (template
  framing, so a replayed reply renders back to the same tokens); vLLM keeps them;
- arguments as JSON values: the gateway keeps the model's own argument text where the
  format writes JSON, vLLM re-serializes it;
- content None and "": the same for a client.
Cases that differ beyond that are named in `DIFFERENT_BY_DESIGN`, with the reason.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.output_corpus import FAMILIES, FAMILY_PARSERS, TOOLS, Case
from support.streaming import stream_call_fragments

from gateway.tokenizer import ChatTokenizer
from gateway.toolparse import OutputParser, ParsedText
from gateway.toolparse.registry import select_parser

WORKER = Path(__file__).with_name("vllm_parsers_worker.py")

VLLM_PARSERS = {
    "hermes": "hermes",
    "qwen3_coder": "qwen3_coder",
    "llama3_json": "llama3_json",
    "qwen3_thinking": "hermes",
    "mistral": "mistral",
    "mistral_v3": "mistral",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v31": "deepseek_v31",
    "kimi_k2": "kimi_k2",
    "llama4_pythonic": "llama4_pythonic",
    "glm45": "glm45",
    "gpt_oss": "openai",
    "magistral": "mistral",
}
"""Our family -> vLLM 0.32's tool parser of the same format."""
EXTRA_TOKENS = {
    "llama3_json": ["<|python_tag|>"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]"],
    "mistral_v3": ["[TOOL_CALLS]"],
    **dict.fromkeys(
        ("deepseek_v3", "deepseek_v31"),
        [
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
        ],
    ),
    "kimi_k2": [
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_end|>",
        "<|tool_call_argument_begin|>",
    ],
    "llama4_pythonic": ["<|python_start|>", "<|python_end|>"],
    "glm45": ["<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
    "magistral": ["[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]"],
}
"""Marker tokens the family's tokenizer has as special tokens (vLLM's parser looks them
up; the test tokenizer lacks them). vLLM tells Mistral's generations apart by `[ARGS]`
being in the vocabulary."""
VLLM_REASONING = {
    "hermes": "qwen3",
    "qwen3_coder": "qwen3",
    "llama3_json": None,
    "qwen3_thinking": "qwen3",
    "mistral": None,
    "mistral_v3": None,
    "deepseek_v3": None,
    "deepseek_v31": None,
    "kimi_k2": None,
    "llama4_pythonic": None,
    "glm45": "glm45",
    "gpt_oss": "openai_gptoss",
    "magistral": "mistral",
}
"""Our family -> vLLM's reasoning parser. vLLM's `qwen3` reasoning parser reads a reply
without `<think>` as reasoning (it assumes the prompt opened the block); the gateway does
so only where the model's generation prompt does open it (`qwen3_thinking`), so for the
other families vLLM runs it only on cases whose reply opens `<think>`."""

DROPPED_SECTION = (
    "vLLM drops the unfinished call section from the reply; the gateway keeps "
    "it as content: nothing generated is silently lost"
)
TRUNCATED_STREAM = (
    "a reply cut off mid-call: vLLM's stream ends with the half call; the "
    "gateway's last delta adds the call's text as content, as its whole "
    "reply keeps it (formats whose arguments stream have also streamed the "
    "half call's name and arguments, as vLLM does)"
)
DIFFERENT_BY_DESIGN: dict[tuple[str, str, str], str] = {
    ("hermes", "truncated", "stream"): TRUNCATED_STREAM,
    ("llama3_json", "truncated", "stream"): TRUNCATED_STREAM,
    ("qwen3_coder", "truncated", "whole"): (
        "vLLM returns a call cut off by max_tokens as a call (empty arguments); the "
        "gateway keeps it as text: running a half-written call acts on a partial command, "
        "and the Hermes and JSON formats keep it as text in vLLM too"
    ),
    ("qwen3_coder", "truncated", "stream"): TRUNCATED_STREAM,
    ("mistral", "truncated", "stream"): TRUNCATED_STREAM,
    ("mistral_v3", "truncated", "stream"): TRUNCATED_STREAM,
    ("mistral", "truncated", "whole"): (
        "vLLM returns a call cut off by max_tokens as a call with its partial arguments "
        "(not JSON); the gateway keeps it as text, as for Qwen3-Coder"
    ),
    ("mistral_v3", "truncated", "whole"): (
        "vLLM returns the unfinished call's text without its [TOOL_CALLS] marker; the "
        "gateway keeps the reply's text as generated, marker included"
    ),
    ("deepseek_v3", "truncated", "whole"): DROPPED_SECTION,
    ("deepseek_v3", "truncated", "stream"): DROPPED_SECTION,
    ("deepseek_v31", "truncated", "stream"): TRUNCATED_STREAM,
    ("kimi_k2", "truncated", "stream"): TRUNCATED_STREAM,
    ("llama4_pythonic", "truncated", "stream"): TRUNCATED_STREAM,
    ("deepseek_v31", "truncated", "whole"): DROPPED_SECTION,
    ("kimi_k2", "truncated", "whole"): (
        "vLLM returns a call cut off by max_tokens as a call with its partial arguments "
        "(not JSON); the gateway keeps it as text, as for Qwen3-Coder"
    ),
    ("glm45", "truncated", "whole"): (
        "vLLM returns a call cut off by max_tokens as a call (empty arguments); the "
        "gateway keeps it as text, as for Qwen3-Coder"
    ),
    ("glm45", "truncated", "stream"): TRUNCATED_STREAM,
    ("llama3_json", "json_in_prose", "whole"): (
        "vLLM's whole parse takes a JSON object out of the middle of prose as a call and "
        "drops the prose (its own stream keeps it as text); the gateway calls only when the "
        "reply is nothing but calls, which is what Llama's template renders"
    ),
}
VLLM_STREAM_DEFECTS: dict[tuple[str, str], str] = {
    ("deepseek_v3", "content_then_call"): (
        "vLLM's deepseek_v3 stream drops the content that arrives in the same delta as "
        "<｜tool▁calls▁begin｜> (depends on the chunking; its whole parse keeps it)"
    ),
    ("deepseek_v31", "one_call"): (
        "vLLM's deepseek_v31 stream never sends the last characters of a call's arguments "
        "(it holds them back and does not flush at the end; its whole parse has them)"
    ),
    ("deepseek_v31", "two_calls"): "as deepseek_v31/one_call",
    ("llama4_pythonic", "list_in_prose"): (
        "vLLM's llama4_pythonic stream never sends a reply that starts with `[` but is not "
        "a call list (its whole parse returns it as content)"
    ),
}
"""Cases whose vLLM stream disagrees with vLLM's own whole parse (a vLLM defect): only its
whole parse is compared, by the rules above."""
CHUNKINGS = 3


def _chunkings(text: str, seed: str) -> list[list[int]]:
    """Token counts per step: one token at a time, then random steps of 1-7 tokens."""
    rng = random.Random(seed)
    budget = 4 * len(text) + 8  # more steps than tokens; the worker stops at the end
    return [[1] * budget] + [
        [rng.randint(1, 7) for _ in range(budget)] for _ in range(CHUNKINGS - 1)
    ]


@pytest.fixture(scope="module")
def vllm_results(vllm_python: str, tiny_model_dir: Path) -> dict[str, Any]:
    """vLLM's parse of every case of every family, from one subprocess (~15 s)."""
    jobs = [
        {
            "id": f"{family}/{case.name}",
            "tool_parser": VLLM_PARSERS[family],
            "reasoning_parser": VLLM_REASONING[family]
            if case.text.startswith(("<think>", "<|channel|>"))
            or FAMILY_PARSERS[family][1]
            or family == "magistral"
            else None,
            "harmony": family == "gpt_oss",
            "text": case.text,
            "tools": TOOLS,
            "extra_tokens": EXTRA_TOKENS.get(family, []),
            "prompt": "<|im_start|>assistant\n" + FAMILY_PARSERS[family][1],
            "chunkings": _chunkings(case.text, f"{family}/{case.name}"),
        }
        for family, cases in FAMILIES.items()
        for case in cases
    ]
    done = subprocess.run(
        [vllm_python, str(WORKER)],
        input=json.dumps({"tokenizer": str(tiny_model_dir), "jobs": jobs}),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def _normalized(
    content: str | None, reasoning: str | None, calls: list[list[str]] | list[tuple[str, str]]
) -> dict[str, Any]:
    return {
        "content": (content or "").strip(),
        "reasoning": (reasoning or "").strip(),
        "calls": [(name, _json_or_text(args)) for name, args in calls],
    }


def _json_or_text(args: str) -> Any:
    """Arguments as a JSON value; a streamed fragment that is none stays text."""
    try:
        return json.loads(args)
    except ValueError:
        return ("not JSON", args)


def _parser(family: str) -> OutputParser:
    tool_format, generation_prompt = FAMILY_PARSERS[family]
    return select_parser(
        None,
        {},
        tool_parser=tool_format,
        renders_tools=False,
        reasoning_parser="mistral" if family == "magistral" else None,
        generation_prompt=generation_prompt,
    ).parser


def _ours(family: str, case: Case) -> dict[str, Any]:
    out: ParsedText = _parser(family).parse(case.text, parse_tools=True, id_seed="s", tools=TOOLS)
    return _normalized(out.content, out.reasoning, [(c.name, c.arguments) for c in out.tool_calls])


def _ours_streamed(tok: ChatTokenizer, family: str, case: Case, seed: str) -> dict[str, Any]:
    """The gateway's chat stream of the case (steps of 1-7 tokens), summed up."""
    rng = random.Random(seed)
    steps = [rng.randint(1, 7) for _ in range(4 * len(case.text) + 8)]
    ours = ChatTokenizer(tok.core, output_parser=_parser(family))
    content, reasoning, calls, _ = stream_call_fragments(ours, case.text, steps)
    return _normalized(content, reasoning, [(name, args) for _, name, args in calls])


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(tiny_model_dir)


CASES = [(family, case) for family, cases in FAMILIES.items() for case in cases]


@pytest.mark.parametrize(("family", "case"), CASES, ids=[f"{f}-{c.name}" for f, c in CASES])
def test_parsers_agree_with_vllm(
    vllm_results: dict[str, Any], tok: ChatTokenizer, family: str, case: Case
) -> None:
    """Our whole parse against vLLM's; our chat stream (call names, then argument
    fragments as they arrive) against each of vLLM's streams."""
    theirs = vllm_results[f"{family}/{case.name}"]
    views = [("whole", theirs["whole"], _ours(family, case))]
    if (family, case.name) not in VLLM_STREAM_DEFECTS:
        views += [
            ("stream", s, _ours_streamed(tok, family, case, f"{family}/{case.name}/{k}"))
            for k, s in enumerate(theirs["streamed"])
        ]
    for view, result, ours in views:
        assert "error" not in result, (view, result.get("error"))
        got = _normalized(result["content"], result["reasoning"], result["calls"])
        reason = DIFFERENT_BY_DESIGN.get((family, case.name, view))
        if reason is None:
            assert got == ours, view
        else:
            assert got != ours, f"no longer different ({view}): drop the entry: {reason}"


def test_differences_by_design_name_real_cases() -> None:
    names = {(f, c.name) for f, c in CASES}
    assert {(f, n) for f, n, _ in DIFFERENT_BY_DESIGN} <= names
    assert set(VLLM_STREAM_DEFECTS) <= names
