"""The prompt-length pre-check through a real gateway: a multi-MB prompt that is surely
over the context is refused with 400 `context_length_exceeded` without the tokenizer
rendering or encoding anything; a prompt under the character bound but over the context
still reaches the exact check after tokenization (same error, exact count)."""

from __future__ import annotations

import httpx
from support.harness import ADMIN_KEY

from engine.echo_backend import start_echo_backend

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def _chat(text: str) -> dict:
    return {
        "model": "areal-policy",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": text}],
    }


def _counting(monkeypatch, core, calls: dict[str, int]) -> None:
    """Count the tokenizer core's render and encode calls (the gateway's own instance)."""
    for name in ("render", "encode", "encode_batch"):
        original = getattr(core, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(core, name, counted)


def test_overlong_prompt_refused_before_render_and_tokenization(
    tmp_path, tiny_model_dir, gateway_factory, monkeypatch
):
    echo = start_echo_backend(tokens=3)
    try:
        with gateway_factory(tmp_path, tiny_model_dir, [echo.url]) as gw:
            tok = gw.state.tokenizer
            assert tok.chars_per_token  # byte-level BPE: a bound exists
            http = httpx.Client(base_url=gw.url, timeout=120, headers=ADMIN)
            calls = {"render": 0, "encode": 0, "encode_batch": 0}
            _counting(monkeypatch, tok.core, calls)

            big = "lorem ipsum dolor sit amet " * 150_000  # ~4 MB
            refused = http.post("/v1/chat/completions", json=_chat(big))
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
            assert "at least" in error["message"], error
            assert calls == {"render": 0, "encode": 0, "encode_batch": 0}, calls  # not tokenized

            # Under the character bound (4096 tokens x chars_per_token) but over the
            # context in tokens: the exact check, after rendering and tokenizing.
            medium = "lorem ipsum dolor sit amet " * 1_000  # 27k chars, ~6k tokens
            assert tok.min_prompt_tokens(_chat(medium)["messages"]) < gw.state.context_length
            exact = http.post("/v1/chat/completions", json=_chat(medium))
            assert exact.status_code == 400, exact.text
            assert exact.json()["error"]["code"] == "context_length_exceeded"
            assert "at least" not in exact.json()["error"]["message"]
            assert calls["render"] >= 1

            fits = http.post("/v1/chat/completions", json=_chat("hello"))
            assert fits.status_code == 200, fits.text
    finally:
        echo.stop()
