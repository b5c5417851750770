"""H2: memory bounded by what is stored. The tokenization cache is bounded in bytes
(text and ids), every role's text counts toward the context-length pre-check, and
`count_tokens` applies it too."""

from __future__ import annotations

import gc
import os
import random
import string
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.tokenizer import ChatTokenizer

ADMIN = {"authorization": "Bearer sk-test-admin"}
MB = 2**20


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _texts(count: int, size: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    letters = string.ascii_lowercase + "      0123456789"
    return ["".join(rng.choices(letters, k=size)) for _ in range(count)]


def test_cache_is_bounded_in_bytes_it_holds(tiny_model_dir: Path) -> None:
    tok = ChatTokenizer.from_pretrained(tiny_model_dir)
    limit = tok._cache_limit
    messages = [{"role": "user", "content": t} for t in _texts(1000, 10_000, 1)]
    tok.encode(tok.render(messages, None))  # 10 MB of text in 1000 cacheable segments
    assert 0 < tok.cache_bytes <= limit
    held = sum(len(ids) * ids.itemsize + len(s) for s, ids in tok._cache.items())
    assert held <= limit


def test_every_role_counts_toward_the_precheck(tiny_model_dir: Path) -> None:
    tok = ChatTokenizer.from_pretrained(tiny_model_dir)
    text = "word " * 2000
    for role in ("system", "user", "assistant"):
        assert tok.min_prompt_tokens([{"role": role, "content": text}]) > 0, role


@pytest.fixture()
def big_gw(serve: Callable[..., AbstractContextManager[Any]]) -> Any:
    with serve("engine.context_length=100000000") as gw:
        yield gw


def test_rss_stays_bounded_after_10mb_inputs(big_gw: Any) -> None:
    """Three different 10 MB conversations counted and kept in the cache as far as it
    allows: the process grows by at most the cache bound plus a transient allowance."""
    url = big_gw.url + "/v1/messages/count_tokens"
    r = httpx.post(
        url,
        headers=ADMIN,
        json={"model": "areal-policy", "messages": [{"role": "user", "content": "warm up"}]},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    gc.collect()
    before = _rss()
    for seed in range(3):
        messages = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": t}
            for i, t in enumerate(_texts(1001, 10_000, seed))
        ]
        r = httpx.post(
            url, headers=ADMIN, json={"model": "areal-policy", "messages": messages}, timeout=120
        )
        assert r.status_code == 200, r.text
        assert httpx.get(big_gw.url + "/health/liveness", timeout=10).status_code == 200
        del messages, r
    gc.collect()
    grown = (_rss() - before) / MB
    held = big_gw.state.tokenizer.cache_bytes / MB
    assert held <= 64
    assert grown < 200, f"RSS grew {grown:.0f} MB (cache holds {held:.0f} MB)"


def test_count_tokens_refuses_a_surely_overlong_prompt(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve() as gw:
        assert gw.state.context_length < 1_000_000
        for role in ("user", "system"):
            body: dict[str, Any] = {
                "model": "areal-policy",
                "messages": [{"role": "user", "content": "x " * 1_000_000}],
            }
            if role == "system":
                body = {
                    "model": "areal-policy",
                    "system": "x " * 1_000_000,
                    "messages": [{"role": "user", "content": "hi"}],
                }
            r = httpx.post(
                gw.url + "/v1/messages/count_tokens", headers=ADMIN, json=body, timeout=60
            )
            assert r.status_code == 400, r.text
            assert "context" in r.text
