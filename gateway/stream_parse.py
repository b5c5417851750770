"""Parsing of SGLang's `/generate` SSE stream payloads: error events, `[DONE]`, coalescing
of cumulative chunks, and `SuffixParser`, which cuts a cumulative chunk to its new
tokens before it is parsed. Used by the engine clients (`gateway/backends/`); no I/O."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Protocol

from pydantic import ValidationError

from areal_service.sglang_protocol import GenerateResponse


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """A `data: {"error": {...}}` line: the backend ended the request with an error."""

    status: int
    message: str


Chunk = GenerateResponse | ErrorEvent | None
"""One SSE payload, parsed; None stands for `[DONE]`."""


class StreamParser(Protocol):
    """Turns the SSE payloads of one network read into chunks (ValidationError when one
    is malformed). One parser per stream: it may keep state between reads."""

    def chunks(self, batch: list[bytes], coalesce: bool) -> list[Chunk]: ...


def parse_chunk(data: bytes) -> GenerateResponse | ErrorEvent:
    """One SSE payload (ValidationError when malformed). `"error":` cannot match inside
    a JSON string, where quotes are escaped, so only payloads with an "error" key, rare,
    take the slow path."""
    if b'"error":' not in data:
        return GenerateResponse.model_validate_json(data)
    obj = json.loads(data)
    if isinstance(obj, dict) and "error" in obj:
        err = obj["error"] if isinstance(obj["error"], dict) else {}
        return ErrorEvent(int(err.get("code") or 500), str(err.get("message", obj["error"])))
    return GenerateResponse.model_validate(obj)


def chunk_objects(batch: list[bytes], coalesce: bool) -> list[Chunk]:
    """The chunks of one read to hand on, parsed. With `coalesce`, a run of cumulative
    chunks shrinks to its last one; error events and `[DONE]` are never dropped."""
    done = b"[DONE]" in batch
    data = batch[: batch.index(b"[DONE]")] if done else batch
    tail: list[Chunk] = [None] if done else []
    if not coalesce or len(data) < 2 or any(b'"error":' in d for d in data[:-1]):
        return [parse_chunk(d) for d in data] + tail
    last = parse_chunk(data[-1])
    if isinstance(last, GenerateResponse) and last.cumulative:
        # Cumulative: the last chunk holds the others. Their tokens share its weight
        # version: a swap aborts the request (pause mode abort), so one request's chunks
        # never span two versions.
        return [last, *tail]
    return [parse_chunk(d) for d in data[:-1]] + [last, *tail]


_IDS_KEY = b'"output_ids":['
_LPS_KEY = b'"output_token_logprobs":['
_TOPS_KEY = b'"output_top_logprobs":['
_TEXT_HEAD = b'{"text":"'
_TEXT_END = b'","output_ids":['


class SuffixParser:
    """Parses one stream's SSE payloads, cutting each CUMULATIVE chunk down to its new
    tokens first, so a chunk costs O(new tokens) instead of O(tokens so far) (a 2k-token
    reply parsed whole at every token is O(n^2)). SGLang offers incremental chunks only
    per server (`--incremental-streaming-output`), so the gateway cannot ask per request.

    How: the previous chunk's `output_ids` and `output_token_logprobs` array bytes are
    kept; when the next chunk's arrays start with exactly those bytes followed by `,` or
    `]`, they are spliced out (a `bytes` compare, C speed), and so is the growing `text`
    (unused: the gateway decodes ids itself). The cut chunk is accepted only if its
    new ids plus the previous count equal `meta_info.completion_tokens`; anything else
    (incremental chunks, top logprobs, text in logprobs, another key order) is parsed
    whole, as before. Quotes cannot appear unescaped inside a JSON string, so the key
    patterns searched for cannot match inside `text`."""

    def __init__(self) -> None:
        self._ids = b""
        """`output_ids` array body of the last chunk (between the brackets)."""
        self._lps: bytes | None = None
        """`output_token_logprobs` array body up to its last `]`, None: not spliceable."""
        self._count = 0
        self._incremental = False
        self._covers = False
        """The chunk parsed last holds every token of the chunks before it."""

    def chunks(self, batch: list[bytes], coalesce: bool) -> list[Chunk]:
        """As `chunk_objects`, with cumulative chunks cut to their new tokens."""
        done = b"[DONE]" in batch
        data = batch[: batch.index(b"[DONE]")] if done else batch
        tail: list[Chunk] = [None] if done else []
        if (
            not coalesce
            or len(data) < 2
            or self._incremental
            or any(b'"error":' in d for d in data[:-1])
        ):
            return [self.parse(d) for d in data] + tail
        last = self.parse(data[-1])
        if not self._covers:  # an error, or incremental: the others count on their own
            return [*(self.parse(d) for d in data[:-1]), last, *tail]
        return [last, *tail]

    def parse(self, data: bytes) -> GenerateResponse | ErrorEvent:
        """One payload; a cumulative chunk after the first comes back holding only the
        tokens new since the previous one parsed."""
        self._covers = False
        if b'"error":' in data:
            self._count = 0
            return parse_chunk(data)
        if self._count and not self._incremental:
            cut = self._splice(data)
            if cut is not None:
                with contextlib.suppress(ValidationError):  # then parsed whole, below
                    chunk = GenerateResponse.model_validate_json(cut[0])
                    total = chunk.meta_info.completion_tokens
                    if len(chunk.output_ids) + self._count == total:
                        self._ids, self._lps, self._count = cut[1], cut[2], total
                        self._covers = True
                        return chunk
        chunk = GenerateResponse.model_validate_json(data)
        if chunk.cumulative:
            self._remember(data, len(chunk.output_ids))
            self._covers = not self._incremental
        elif self._count or len(chunk.output_ids) < chunk.meta_info.completion_tokens:
            self._incremental = True
        return chunk

    def _splice(self, data: bytes) -> tuple[bytes, bytes, bytes | None] | None:
        """(`data` without the known array prefixes and the text, the new `output_ids`
        body, the new logprobs body), or None when `data` does not extend the last."""
        if b"output_top_logprobs" in data and _TOPS_KEY + b"]" not in data:
            return None  # nested arrays: not cut (only when the client asked for them)
        a = data.find(_IDS_KEY) + len(_IDS_KEY)
        b = a + len(self._ids)
        sep = data[b : b + 1]
        if a < len(_IDS_KEY) or sep not in (b",", b"]") or data[a:b] != self._ids:
            return None
        ids_end = data.find(b"]", b)
        head = data[:a]
        if head.startswith(_TEXT_HEAD):  # drop the growing text (SGLang's key order)
            end = head.find(_TEXT_END)
            if end > 0:
                head = _TEXT_HEAD + head[end:]
        lps = self._lps
        if lps is None:
            if _LPS_KEY in data:
                return None
            return head + data[b + 1 if sep == b"," else b :], data[a:ids_end], None
        c = data.find(_LPS_KEY, ids_end) + len(_LPS_KEY)
        d = c + len(lps)
        lsep = data[d : d + 1]
        if c < len(_LPS_KEY) or lsep not in (b",", b"]") or data[c:d] != lps:
            return None
        close = data.find(b"]]", d) if lsep == b"," else d - 1
        if close < 0:
            return None
        new_lps = data[c : close + 1]
        if lsep == b"," and b'"' in new_lps:
            return None  # token text in the logprobs: "]]" may sit inside a string
        cut = b"".join(
            (head, data[b + 1 if sep == b"," else b : c], data[d + 1 if lsep == b"," else d :])
        )
        return cut, data[a:ids_end], new_lps

    def _remember(self, data: bytes, count: int) -> None:
        """The array bodies of `data` (a whole cumulative chunk), for the next splice."""
        i = data.find(_IDS_KEY)
        end = data.find(b"]", i) if i >= 0 else -1
        if end < 0:
            self._count = 0
            return
        self._ids = data[i + len(_IDS_KEY) : end]
        self._count = count
        j = data.find(_LPS_KEY, end)
        self._lps = None
        if j >= 0:
            c = j + len(_LPS_KEY)
            close = data.find(b"]]", c)
            if data[c : c + 1] == b"]":
                self._lps = b""
            elif close >= 0 and b'"' not in data[c : close + 1]:
                self._lps = data[c : close + 1]


class WholeChunks:
    """The stream parser without cutting: each payload parsed whole (`chunk_objects`)."""

    @staticmethod
    def chunks(batch: list[bytes], coalesce: bool) -> list[Chunk]:
        return chunk_objects(batch, coalesce)
