"""Runs vLLM's own tool-call and reasoning parsers on a corpus, in vLLM's interpreter (the
gateway's environment has no vLLM, no torch). Reads one JSON object from stdin:
`{"tokenizer": dir, "jobs": [{"id", "tool_parser", "reasoning_parser" (or null), "text",
"tools", "chunkings": [[token counts...]...]}]}`, writes `{id: result}` to stdout, where a
result holds the whole parse (`content`, `reasoning`, `calls`: [[name, arguments]]) and
one streamed parse per chunking (the deltas summed the same way). Exceptions are
results too (`error`), so one case cannot hide the others."""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager

EXTRA_TOKENS = {"llama3_json": ["<|python_tag|>"]}
"""Marker tokens a vLLM parser looks up in the vocabulary (the test tokenizer lacks them;
the corpus never contains them)."""


def tokenizer_for(path: str, parser: str) -> Any:
    tok = AutoTokenizer.from_pretrained(path)
    if parser in EXTRA_TOKENS:
        tok.add_special_tokens({"additional_special_tokens": EXTRA_TOKENS[parser]})
    return tok


def whole(job: dict[str, Any], tok: Any, request: Any) -> dict[str, Any]:
    text = job["text"]
    reasoning = None
    if job["reasoning_parser"]:
        rp = ReasoningParserManager.get_reasoning_parser(job["reasoning_parser"])(tok)
        reasoning, text = rp.extract_reasoning(text, request)
        text = text or ""
    tp = ToolParserManager.get_tool_parser(job["tool_parser"])(tok, request.tools)
    info = tp.extract_tool_calls(text, request)
    return {"content": info.content, "reasoning": reasoning,
            "calls": [[c.function.name, c.function.arguments] for c in info.tool_calls]}


def streamed(job: dict[str, Any], tok: Any, request: Any, chunking: list[int]
             ) -> dict[str, Any]:
    ids = tok.encode(job["text"], add_special_tokens=False)
    rp = (ReasoningParserManager.get_reasoning_parser(job["reasoning_parser"])(tok)
          if job["reasoning_parser"] else None)
    tp = ToolParserManager.get_tool_parser(job["tool_parser"])(tok, request.tools)
    content, reasoning = "", ""
    args: dict[int, list[str]] = {}
    prev_text, prev_ids, pos = "", [], 0
    tool_prev_text, tool_prev_ids = "", []
    in_reasoning = rp is not None
    pending: list[int] = []
    for size in chunking:
        pending += ids[pos:pos + size]
        pos += size
        cur_ids = prev_ids + pending
        cur_text = tok.decode(cur_ids)
        if cur_text.endswith("\ufffd") and pos < len(ids):
            continue  # an incomplete UTF-8 sequence: vLLM's detokenizer holds it back too
        delta_ids, pending = pending, []
        delta_text = cur_text[len(prev_text):]
        if in_reasoning:
            msg = rp.extract_reasoning_streaming(prev_text, cur_text, delta_text, prev_ids,
                                                 cur_ids, delta_ids)
            prev_text, prev_ids = cur_text, cur_ids
            if msg is not None:
                reasoning += msg.reasoning or ""
            if not rp.is_reasoning_end(cur_ids):
                continue
            # Reasoning ended in this delta: what came after it is the tool parser's
            # first delta (as vLLM's serving layer hands it over).
            in_reasoning = False
            delta_text = msg.content or "" if msg is not None else ""
            delta_ids = tok.encode(delta_text, add_special_tokens=False)
            if not delta_text:
                continue
        tool_cur_text = tool_prev_text + delta_text
        tool_cur_ids = tool_prev_ids + list(delta_ids)
        msg = tp.extract_tool_calls_streaming(tool_prev_text, tool_cur_text, delta_text,
                                              tool_prev_ids, tool_cur_ids, delta_ids, request)
        if msg is not None:
            content += msg.content or ""
            for call in msg.tool_calls or []:
                entry = args.setdefault(call.index, ["", ""])
                if call.function is not None:
                    entry[0] += call.function.name or ""
                    entry[1] += call.function.arguments or ""
        tool_prev_text, tool_prev_ids = tool_cur_text, tool_cur_ids
        prev_text, prev_ids = cur_text, cur_ids
    return {"content": content, "reasoning": reasoning or None,
            "calls": [args[i] for i in sorted(args)]}


def main() -> None:
    spec = json.load(sys.stdin)
    tokenizers: dict[str, Any] = {}
    out: dict[str, Any] = {}
    for job in spec["jobs"]:
        tok = tokenizers.get(job["tool_parser"])
        if tok is None:
            tok = tokenizers[job["tool_parser"]] = tokenizer_for(spec["tokenizer"],
                                                                 job["tool_parser"])
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                        tools=job["tools"])
        result: dict[str, Any] = {}
        try:
            result["whole"] = whole(job, tok, request)
        except Exception:  # noqa: BLE001 - reported to the test, which names the case
            result["whole"] = {"error": traceback.format_exc(limit=3)}
        streams = []
        for chunking in job["chunkings"]:
            try:
                streams.append(streamed(job, tok, request, chunking))
            except Exception:  # noqa: BLE001 - as above
                streams.append({"error": traceback.format_exc(limit=3)})
        result["streamed"] = streams
        out[job["id"]] = result
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
