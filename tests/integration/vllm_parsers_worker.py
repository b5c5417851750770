"""Runs vLLM's own tool-call and reasoning parsers on a corpus, in vLLM's interpreter (the
gateway's environment has no vLLM, no torch). vLLM's serving layer composes the two named
parsers into one (`ParserManager.get_parser`) and calls `parse` on a whole reply and
`parse_delta` per streamed step (`finished` on the last); this does the same.

Reads one JSON object from stdin: `{"tokenizer": dir, "jobs": [{"id", "tool_parser",
"reasoning_parser" (or null), "harmony", "text", "tools", "extra_tokens", "prompt",
"chunkings": [[token counts...]...]}]}`; writes `{id: {"whole": result, "streamed":
[result per chunking]}}`, a result being `{"content", "reasoning", "calls": [[name,
arguments]]}` (streamed deltas summed), or `{"error": traceback}`, so one case cannot hide
the others."""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager


def tokenizer_for(path: str, extra_tokens: list[str]) -> Any:
    """The test tokenizer plus the family's marker tokens, as special tokens (what the
    vLLM parser looks up in the vocabulary; the tiny model has none of them)."""
    tok = AutoTokenizer.from_pretrained(path)
    if extra_tokens:
        tok.add_special_tokens({"additional_special_tokens": extra_tokens})
    return tok


class HarmonyTokenizer:
    """gpt-oss's tokenizer as vLLM's harmony parser uses it: openai-harmony's encoding
    (the o200k harmony vocabulary, special tokens as tokens)."""

    def __init__(self) -> None:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        self._enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids: list[int], **_: Any) -> str:
        return self._enc.decode(ids)

    def get_vocab(self) -> dict[str, int]:
        return {}


def parser_for(job: dict[str, Any], tok: Any) -> Any:
    cls = ParserManager.get_parser(
        tool_parser_name=job["tool_parser"],
        reasoning_parser_name=job["reasoning_parser"],
        enable_auto_tools=True,
        is_harmony=job["harmony"],
        tokenizer=None if job["harmony"] else tok,
    )
    return cls(tok, job["tools"])


def whole(job: dict[str, Any], tok: Any, request: Any) -> dict[str, Any]:
    ids = tok.encode(job["text"], add_special_tokens=False)
    reasoning, content, calls = parser_for(job, tok).parse(
        job["text"], request, enable_auto_tools=True, model_output_token_ids=ids
    )
    return {
        "content": content,
        "reasoning": reasoning,
        "calls": [[c.name, c.arguments] for c in calls or ()],
    }


def streamed(job: dict[str, Any], tok: Any, request: Any, chunking: list[int]) -> dict[str, Any]:
    """Deltas as vLLM's detokenizer hands them on: the text the new ids complete (an
    incomplete UTF-8 sequence waits for the next ids)."""
    parser = parser_for(job, tok)
    ids = tok.encode(job["text"], add_special_tokens=False)
    prompt = tok.encode(job["prompt"], add_special_tokens=False)
    content, reasoning = "", ""
    calls: dict[int, list[str]] = {}
    sent_text, sent, pos = "", 0, 0
    for size in chunking:
        pos = min(pos + size, len(ids))
        text = tok.decode(ids[:pos])
        finished = pos == len(ids)
        if text.endswith("\ufffd") and not finished:
            continue
        msg = parser.parse_delta(
            text[len(sent_text) :],
            list(ids[sent:pos]),
            request,
            prompt_token_ids=prompt,
            finished=finished,
        )
        sent_text, sent = text, pos
        if msg is not None:
            content += msg.content or ""
            reasoning += msg.reasoning or ""
            for call in msg.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                if call.function is not None:
                    entry[0] += call.function.name or ""
                    entry[1] += call.function.arguments or ""
        if finished:
            break
    return {
        "content": content,
        "reasoning": reasoning or None,
        "calls": [calls[i] for i in sorted(calls)],
    }


def main() -> None:
    spec = json.load(sys.stdin)
    tokenizers: dict[str, Any] = {}
    out: dict[str, Any] = {}
    for job in spec["jobs"]:
        key = "harmony" if job["harmony"] else ",".join(job["extra_tokens"])
        tok = tokenizers.get(key)
        if tok is None:
            tok = tokenizers[key] = (
                HarmonyTokenizer()
                if job["harmony"]
                else tokenizer_for(spec["tokenizer"], job["extra_tokens"])
            )
        request = ChatCompletionRequest(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            tools=job["tools"],
            tool_choice="auto",
        )
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
