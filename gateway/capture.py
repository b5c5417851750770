"""Capture: one `CompletionRecord` per generated choice, durable before the reply.

The record holds exactly what the backend produced (prompt ids as sent, output ids,
behaviour logprobs, per-token versions) next to the request and response JSON.
Choice 0 of a request is stored under the response id; choice i > 0 under `<id>.<i>`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from areal_service.types import CompletionRecord
from gateway.backends import Generation
from gateway.errors import OpenAIError
from gateway.state import GatewayState
from gateway.translate import ParsedChoice, SamplingSpec


def choice_record_id(completion_id: str, index: int) -> str:
    """Store id of choice `index` of the response `completion_id`."""
    return completion_id if index == 0 else f"{completion_id}.{index}"


def build_records(
    *,
    completion_id: str,
    model: str,
    requested_model: str | None = None,
    prompt_ids: Sequence[int],
    generations: Sequence[Generation],
    choices: Sequence[ParsedChoice],
    spec: SamplingSpec,
    request_json: dict[str, Any],
    response_json: dict[str, Any],
    session_id: str | None,
    api_key_id: str | None,
    started: float,
    continuity_keys: Sequence[str | None] = (),
) -> list[CompletionRecord]:
    """Records for every choice of one request (request/response JSON on each). `model`
    is the policy that served it, `requested_model` the name the client sent;
    `continuity_keys`: one per choice (`Continuity.keys`), or none."""
    keys = continuity_keys or [None] * len(choices)
    latency_ms = (time.perf_counter() - started) * 1000.0
    prompt = tuple(prompt_ids)
    return [
        CompletionRecord(
            id=choice_record_id(completion_id, i),
            model=model,
            prompt_ids=prompt,
            output_ids=gen.output_ids,
            output_logprobs=gen.output_logprobs,
            output_versions=gen.output_versions,
            finish_reason=choice.finish_reason,
            session_id=session_id,
            api_key_id=api_key_id,
            request_json=request_json,
            response_json=response_json,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            backend=gen.backend,
            latency_ms=latency_ms,
            prompt_tokens=len(prompt),
            completion_tokens=len(gen.output_ids),
            requested_model=requested_model,
            continuity_key=key,
        )
        for i, (gen, choice, key) in enumerate(zip(generations, choices, keys, strict=True))
    ]


async def persist(state: GatewayState, records: Sequence[CompletionRecord]) -> None:
    """Wait until every record is durable; a failed write becomes a 503 (the client's
    retry is safe: nothing was acknowledged), never a silently lost completion."""
    if not state.config.gateway.capture:
        return
    t0 = time.perf_counter()
    # Parent links are set here, right before the write, so each turn finds the previous
    # one even if that write is still in the group-commit queue; or, when other processes
    # share the store, by the writer per batch (`ParentLinker.link_batch`).
    if state.writer.prepare is None:
        records = [await state.linker.alink_parent(r) for r in records]
    try:
        if len(records) == 1:  # the common case: no gather, no extra task
            await state.writer.write(records[0])
        else:
            await asyncio.gather(*(state.writer.write(r) for r in records))
    except Exception as exc:  # any store failure: refuse to acknowledge
        raise OpenAIError(
            503,
            f"the completion could not be recorded ({type(exc).__name__}); retry the request",
            type="server_error",
            code="capture_failed",
            headers={"retry-after": "1"},
        ) from exc
    finally:
        state.metrics.capture_wait.observe(time.perf_counter() - t0)
