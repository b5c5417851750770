"""The learning audit's no_eos case over HTTP: an output the client's stop string ended
(`finish_reason: "stop"`, no EOS token at its end) is complete, and one that hit
`max_tokens` is truncated, in the sequences the trainer builds from what the gateway
recorded (`trainer.no_eos: mask` drops only the latter)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
from transformers import AutoConfig

from areal_service.config import TrainerConfig
from areal_service.episodes import build_sequences
from areal_service.types import EpisodeGroup
from trainer.truncation import apply_no_eos, is_truncated

ADMIN = {"authorization": "Bearer sk-test-admin"}


def _ask(http: httpx.Client, **extra: Any) -> dict[str, Any]:
    reply = http.post(
        "/v1/chat/completions",
        json={
            "model": "areal-policy",
            "temperature": 0,
            "messages": [{"role": "user", "content": "Count: one two three"}],
            **extra,
        },
    )
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def test_a_stop_string_ending_is_not_truncated(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve() as gw, httpx.Client(base_url=gw.url, headers=ADMIN, timeout=60) as http:
        free = _ask(http, max_tokens=12)
        text = free["choices"][0]["message"]["content"]
        assert free["choices"][0]["finish_reason"] == "length" and text, free
        stop = text[-1]  # a character the greedy output reaches (the tiny model's: "\n")
        stopped = _ask(http, max_tokens=12, stop=[stop])
        assert stopped["choices"][0]["finish_reason"] == "stop", stopped
        cut = _ask(http, max_tokens=1)
        assert cut["choices"][0]["finish_reason"] == "length", cut
        store = gw.state.store
        records = [store.get_completion(r["id"]) for r in (stopped, cut)]
        assert all(r is not None for r in records)
        eos = AutoConfig.from_pretrained(gw.config.engine.model).eos_token_id
        assert records[0].output_ids and records[0].output_ids[-1] not in {eos}  # the old rule
        sequences = build_sequences(records, {r.id: 1.0 for r in records})
        assert [is_truncated(s) for s in sequences] == [False, True]
        group = EpisodeGroup(
            group_id="g",
            session_ids=("s",),
            sequences=tuple(sequences),
            session_returns=(1.0,),
            staleness=0,
        )
        (masked,) = apply_no_eos([group], TrainerConfig(no_eos="mask"))
        assert any(masked.sequences[0].loss_mask) and not any(masked.sequences[1].loss_mask)
