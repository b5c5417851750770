"""SGLangClient and BackendPool against the echo backend over real loopback HTTP."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.loopback import free_port

from areal_service.sglang_protocol import (
    FinishReason,
    GenerateResponse,
    MetaInfo,
    parse_version,
)
from engine.echo_backend import EOS_ID, EchoBackendHandle, echo_token, start_echo_backend
from gateway.backends import BackendError, BackendUnavailable, SGLangClient, TokenRequest
from gateway.routing import BackendPool
from gateway.stream_parse import ErrorEvent, chunk_objects

PROMPT = (11, 12, 13, 14)


def expected_ids(n: int, prompt: tuple[int, ...] = PROMPT) -> list[int]:
    return [echo_token(prompt[0], len(prompt) + i) for i in range(n)]


@pytest.fixture
def echo() -> Iterator[EchoBackendHandle]:
    with start_echo_backend(tokens=32) as handle:
        yield handle


@pytest.fixture
def slow_echo() -> Iterator[EchoBackendHandle]:
    """10 ms per token: a 40-token request takes ~0.4 s, long enough to interrupt."""
    with start_echo_backend(tokens=1000, token_delay_ms=10) as handle:
        yield handle


def req(max_new: int, *, rid: str | None = None, **kw: object) -> TokenRequest:
    return TokenRequest.for_tokens(
        PROMPT, {"max_new_tokens": max_new}, rid=rid or uuid.uuid4().hex, **kw
    )


async def wait_for(cond: object, timeout: float = 2.0) -> None:
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.01)


# -- thin endpoints --------------------------------------------------------------------
async def test_generate_length_and_stop(echo: EchoBackendHandle) -> None:
    async with SGLangClient(echo.url, timeout_s=10) as client:
        r = await client.generate(req(8, rid="r-length"))
        assert list(r.output_ids) == expected_ids(8)
        lps = r.output_logprobs()
        assert len(lps) == 8 and all(lp is not None and lp < 0 for lp in lps)
        assert r.finish_reason is not None and r.finish_reason.type == "length"
        assert r.finish_reason.length == 8
        meta = r.meta_info
        assert (meta.prompt_tokens, meta.completion_tokens, meta.id) == (4, 8, "r-length")
        assert meta.weight_version == "default" and meta.e2e_latency is not None

        stop = await client.generate(req(100))  # 32 tokens < 100: ends with EOS
        assert stop.finish_reason is not None and stop.finish_reason.type == "stop"
        assert stop.finish_reason.matched == EOS_ID and stop.output_ids[-1] == EOS_ID
        assert len(stop.output_ids) == 32


async def test_generate_stream_cumulative_chunks(echo: EchoBackendHandle) -> None:
    async with SGLangClient(echo.url, timeout_s=10) as client:
        chunks = [c async for c in client.generate_stream(req(5))]
    assert [len(c.output_ids) for c in chunks] == [1, 2, 3, 4, 5]
    assert [c.finish_reason for c in chunks[:-1]] == [None] * 4
    assert chunks[-1].finish_reason is not None and chunks[-1].finish_reason.type == "length"
    assert list(chunks[-1].output_ids) == expected_ids(5)
    assert len(chunks[-1].output_logprobs()) == 5


def test_coalescing_keeps_the_newest_cumulative_chunk_and_every_marker() -> None:
    def chunk(ids: list[int], total: int | None = None) -> bytes:
        meta = {
            "completion_tokens": len(ids) if total is None else total,
            "output_token_logprobs": [[-0.5, i, None] for i in ids],
        }
        return json.dumps({"output_ids": ids, "meta_info": meta}).encode()

    def parsed(raw: bytes) -> GenerateResponse:
        return GenerateResponse.model_validate_json(raw)

    cumulative = [chunk([1]), chunk([1, 2]), chunk([1, 2, 3])]
    assert chunk_objects(cumulative, coalesce=True) == [parsed(cumulative[-1])]
    assert chunk_objects(cumulative, coalesce=False) == [parsed(c) for c in cumulative]
    assert chunk_objects([*cumulative, b"[DONE]"], coalesce=True) == [parsed(cumulative[-1]), None]
    # Incremental chunks (--incremental-streaming-output) each carry new tokens.
    incremental = [chunk([1], 1), chunk([2], 2), chunk([3], 3)]
    assert chunk_objects(incremental, coalesce=True) == [parsed(c) for c in incremental]
    # An error event is never skipped, whatever follows it.
    error = b'{"error": {"message": "boom", "code": 500}}'
    got = chunk_objects([chunk([1]), error, chunk([1, 2])], coalesce=True)
    assert got[1] == ErrorEvent(500, "boom") and len(got) == 3
    # Text that mentions "error": inside a JSON string does not disable coalescing.
    text = json.dumps(
        {"text": 'say "error": no', "output_ids": [1], "meta_info": {"completion_tokens": 1}}
    ).encode()
    assert chunk_objects([text, chunk([1, 2])], coalesce=True) == [parsed(chunk([1, 2]))]


async def test_coalesced_stream_of_a_slow_reader_has_the_same_tokens(
    echo: EchoBackendHandle,
) -> None:
    """A reader that falls behind gets fewer, larger deltas, never different tokens."""
    async with SGLangClient(echo.url) as client:
        deltas = []
        async for delta in client.generate_interruptible_stream(req(32)):
            deltas.append(delta)
            await asyncio.sleep(0.02)  # let the backend run ahead: chunks pile up
        ids = [i for d in deltas for i in d.output_ids]
        assert ids == expected_ids(32)
        assert sum(len(d.output_logprobs) for d in deltas) == 32
        assert deltas[-1].finish_reason is not None
        assert len(deltas) < 32  # coalesced: a plain per-chunk stream has 32


async def test_errors_are_typed(echo: EchoBackendHandle) -> None:
    async with SGLangClient(echo.url, timeout_s=10) as client:
        with pytest.raises(BackendError) as bad:
            await client.generate(TokenRequest.for_tokens((), {}, rid="empty"))
        assert bad.value.status == 400 and "input_ids" in bad.value.message
        assert not isinstance(bad.value, BackendUnavailable)

        # A mid-stream `data: {"error": ...}` event raises after the chunks before it.
        hooked = req(9, echo_error_after=3)
        seen = []
        with pytest.raises(BackendError, match="echo_error_after") as mid:
            async for c in client.generate_stream(hooked):
                seen.append(c)
        assert len(seen) == 3 and mid.value.status == 400

    dead = SGLangClient(f"http://127.0.0.1:{free_port()}", timeout_s=5)
    with pytest.raises(BackendUnavailable) as down:
        await dead.generate(req(4))
    assert down.value.sent is False and down.value.status == 503
    assert await dead.health() is False
    await dead.aclose()


async def test_info_health_flush_and_legacy_fallback(echo: EchoBackendHandle) -> None:
    async with SGLangClient(echo.url, timeout_s=10) as client:
        assert await client.health() is True
        info = await client.model_info()
        assert info.weight_version == "default" and info.is_generation
        assert (await client.server_info())["served_model_name"] == "echo"
        await client.flush_cache()
    with start_echo_backend(legacy_info=True) as legacy:
        async with SGLangClient(legacy.url, timeout_s=10) as client:
            assert (await client.model_info()).model_path == "echo"  # via /get_model_info
            assert "tp_size" in await client.server_info()


# -- cancellation aborts ---------------------------------------------------------------
async def test_cancel_and_early_close_abort_the_request(slow_echo: EchoBackendHandle) -> None:
    running = slow_echo.backend.running  # type: ignore[union-attr]
    async with SGLangClient(slow_echo.url, timeout_s=10) as client:
        task = asyncio.create_task(client.generate(req(500, rid="cancel-me")))
        await wait_for(lambda: "cancel-me" in running)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: "cancel-me" not in running, timeout=1.0)  # not 5 s of tokens

        stream = client.generate_stream(req(500, rid="close-me"))
        first = await anext(stream)
        assert len(first.output_ids) == 1
        await stream.aclose()
        await wait_for(lambda: "close-me" not in running, timeout=1.0)


# -- interruptible generation across a weight swap ------------------------------------
async def test_interruptible_stream_spans_a_swap(
    slow_echo: EchoBackendHandle, tmp_path: Path
) -> None:
    async with SGLangClient(slow_echo.url, timeout_s=10, resubmit_wait_s=0.01) as client:
        deltas, swap = [], None
        async for d in client.generate_interruptible_stream(req(40, rid="interrupt-s")):
            deltas.append(d)
            if sum(len(x.output_ids) for x in deltas) >= 10 and swap is None:
                swap = asyncio.create_task(client.swap_weights(str(tmp_path), 1))
        timings = await swap  # type: ignore[misc]
    ids = [t for d in deltas for t in d.output_ids]
    versions = [v for d in deltas for v in d.output_versions]
    assert ids == expected_ids(40)  # one uninterrupted stream, no duplicates or gaps
    assert len([lp for d in deltas for lp in d.output_logprobs]) == 40
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    last = deltas[-1]
    assert last.finish_reason is not None and last.finish_reason.type == "length"
    assert last.resubmissions >= 1 and last.completion_tokens == 40 and last.prompt_tokens == 4
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert timings.total_s >= timings.update_s >= 0
    assert slow_echo.backend.paused is False  # type: ignore[union-attr]


async def test_interruptible_generate_spans_a_swap(
    slow_echo: EchoBackendHandle, tmp_path: Path
) -> None:
    async with SGLangClient(slow_echo.url, timeout_s=10, resubmit_wait_s=0.01) as client:
        task = asyncio.create_task(client.generate_interruptible(req(40, rid="interrupt-n")))
        running = slow_echo.backend.running  # type: ignore[union-attr]
        # Some (not all) tokens in, however loaded the machine is.
        await wait_for(lambda: "interrupt-n" in running and running["interrupt-n"].produced >= 5)
        await client.pause_generation("abort")
        await client.update_weights_from_disk(str(tmp_path), weight_version="7")
        await client.continue_generation()
        gen = await task
    assert list(gen.output_ids) == expected_ids(40)
    assert gen.finish_reason.type == "length" and gen.completion_tokens == 40
    assert gen.resubmissions == 1 and gen.prompt_tokens == 4
    assert set(gen.output_versions) == {0, 7}
    assert gen.output_versions[0] == 0 and gen.output_versions[-1] == 7
    assert len(gen.output_logprobs) == 40


async def test_too_many_aborts_raise_unavailable(slow_echo: EchoBackendHandle) -> None:
    async with SGLangClient(
        slow_echo.url, timeout_s=10, max_resubmissions=2, resubmit_wait_s=0.01
    ) as client:
        task = asyncio.create_task(client.generate_interruptible(req(400, rid="stuck")))
        running = slow_echo.backend.running  # type: ignore[union-attr]
        for rid in ("stuck", "stuck-1", "stuck-2"):  # abort every round the client submits
            await wait_for(lambda rid=rid: rid in running)
            await client.abort_request(rid)
        with pytest.raises(BackendUnavailable, match="aborted 3 times"):
            await task


def test_parse_version() -> None:
    assert [parse_version(v) for v in ("3", " 12 ", "default", "step-4", "", None)] == [
        3,
        12,
        0,
        0,
        0,
        0,
    ]


# -- swap pairing ----------------------------------------------------------------------
async def test_swap_weights_always_continues(echo: EchoBackendHandle, tmp_path: Path) -> None:
    calls = echo.backend.calls  # type: ignore[union-attr]
    async with SGLangClient(echo.url, timeout_s=10) as client:
        with pytest.raises(BackendError) as failed:
            await client.swap_weights(str(tmp_path / "missing"), 5)
        assert failed.value.status == 400 and "does not exist" in failed.value.message
        assert calls == ["pause_generation", "update_weights_from_disk", "continue_generation"]
        assert (await client.server_info())["paused"] is False
        assert (await client.model_info()).weight_version == "default"
        r = await asyncio.wait_for(client.generate(req(3)), 2)  # not left paused
        assert len(r.output_ids) == 3

        t = await client.swap_weights(str(tmp_path), 5)
        assert min(t.pause_s, t.update_s, t.continue_s) >= 0
        assert abs(t.total_s - (t.pause_s + t.update_s + t.continue_s)) < 1e-6
        assert (await client.model_info()).weight_version == "5"
        assert (await client.generate(req(2))).meta_info.weight_version == "5"


# -- BackendPool -----------------------------------------------------------------------
async def test_pool_sticky_and_least_in_flight() -> None:
    with start_echo_backend() as a, start_echo_backend() as b:
        pool = BackendPool([a.url, b.url])
        first = pool.pick("s1")
        assert all(pool.pick("s1") is first for _ in range(5))
        async with pool.lease("s1") as held:
            assert held is first and held.in_flight == 1
            other = pool.pick("s2")  # new session: the idle backend
            assert other is not first
            async with pool.lease("s2"), pool.lease("s2"):
                assert other.in_flight == 2
                assert pool.pick("s3") is first  # 1 in flight < 2
        assert [s.in_flight for s in pool.status()] == [0, 0]
        gen = await pool.generate_interruptible(req(6), session_id="s2")
        assert list(gen.output_ids) == expected_ids(6)
        await pool.aclose()


async def test_pool_fails_over_from_a_dead_backend() -> None:
    dead_url = f"http://127.0.0.1:{free_port()}"
    with start_echo_backend() as live:
        pool = BackendPool([dead_url, live.url])
        assert pool.pick().url == dead_url  # rotation starts at the dead one...
        pool._rr = 0
        gen = await pool.generate_interruptible(req(5), session_id="s")
        assert list(gen.output_ids) == expected_ids(5)  # ...and the request lands on live
        assert [s.healthy for s in pool.status()] == [False, True]
        assert pool.pick("s").url == live.url
        pool.mark_up(pool.backends[0])
        pool._rr = 0
        deltas = [d async for d in pool.generate_interruptible_stream(req(5), session_id="t")]
        assert [t for d in deltas for t in d.output_ids] == expected_ids(5)
        assert not pool.status()[0].healthy
        await pool.aclose()


async def test_pool_unavailable_after_deadline_then_readmits() -> None:
    port = free_port()
    pool = BackendPool([f"http://127.0.0.1:{port}"], probe_interval_s=0.05)
    pool.mark_down(pool.backends[0], "test")
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable, match="no healthy backend"):
        await pool.generate_interruptible(req(3), deadline_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    with start_echo_backend(port=port):
        await pool.wait_until_available(2.0)  # the /health probe re-admits it
        assert pool.status()[0].healthy
        assert len((await pool.generate_interruptible(req(3))).output_ids) == 3
    await pool.aclose()


async def test_pool_swap_and_resync_on_readmission(tmp_path: Path) -> None:
    with start_echo_backend() as a, start_echo_backend() as b:
        pool = BackendPool([a.url, b.url], health_interval_s=0.05)
        pool.mark_down(pool.backends[1], "test")  # b misses the swap
        timings = await pool.swap_weights(str(tmp_path), 2)
        assert list(timings) == [a.url]
        await pool.start()  # health loop: b passes /health, is re-synced, re-admitted
        await wait_for(lambda: pool.status()[1].healthy)
        for backend in pool.backends:
            assert (await backend.client.model_info()).weight_version == "2"
        with pytest.raises(BackendError):
            await pool.swap_weights(str(tmp_path / "missing"), 3)
        assert pool.target == (str(tmp_path), 2)
        assert all(s.healthy for s in pool.status())  # a rejected load is not an outage
        await pool.aclose()


async def test_pool_health_checks_take_a_backend_out_and_back(echo: EchoBackendHandle) -> None:
    pool = BackendPool([echo.url], unhealthy_after=2, probe_interval_s=0)  # no backoff
    echo.call(lambda: setattr(echo.backend, "healthy", False))  # /health now answers 503
    await pool.check_health()
    assert pool.status()[0].healthy  # one failed check is tolerated
    await pool.check_health()
    assert not pool.status()[0].healthy
    with pytest.raises(BackendUnavailable):
        pool.pick("s")
    echo.call(lambda: setattr(echo.backend, "healthy", True))
    await pool.check_health()
    assert pool.status()[0].healthy and pool.pick("s").url == echo.url
    await pool.aclose()


async def test_a_down_backend_is_probed_with_backoff_and_readmitted() -> None:
    """Probes of a down backend double their interval (0.05, 0.1, 0.2, 0.4 s cap) instead
    of running at every poll; it is back in rotation at the first probe after recovery,
    and sessions that moved off it meanwhile stay where they went."""
    probes: list[str] = []

    class Counting(SGLangClient):
        async def health(self, timeout_s: float = 10.0) -> bool:
            probes.append(self.base_url)
            return await super().health(timeout_s)

    with start_echo_backend() as a, start_echo_backend() as b:
        pool = BackendPool(
            [a.url, b.url],
            probe_interval_s=0.05,
            max_probe_interval_s=0.4,
            client_factory=lambda url: Counting(url),
        )
        pool._rr = 1
        assert pool.pick("s").url == b.url
        b.call(lambda: setattr(b.backend, "healthy", False))
        pool.mark_down(pool.backends[1], "test")
        assert pool.pick("s").url == a.url  # the session moves to the healthy backend
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # poll 100 times a second
            await pool.check_health(only_down=True)
            await asyncio.sleep(0.01)
        assert 2 <= probes.count(b.url) <= 6 and a.url not in probes
        assert pool.backends[1].probe_backoff_s == pytest.approx(0.4)
        b.call(lambda: setattr(b.backend, "healthy", True))
        end = time.monotonic() + 0.6
        while not pool.status()[1].healthy:
            assert time.monotonic() < end, "not re-admitted within one capped backoff"
            await pool.check_health(only_down=True)
            await asyncio.sleep(0.01)
        assert pool.backends[1].probe_backoff_s == 0
        assert pool.pick("s").url == a.url  # sticky: no move back while a is healthy
        await pool.aclose()


@pytest.mark.processes
async def test_echo_backend_subprocess_mode() -> None:
    handle = start_echo_backend(subprocess_mode=True, tokens=3)
    try:
        async with SGLangClient(handle.url, timeout_s=10) as client:
            assert len((await client.generate(req(10))).output_ids) == 3
    finally:
        handle.stop()
    assert handle._proc is not None and handle._proc.returncode is not None


async def test_an_aborted_rounds_last_chunk_keeps_the_rounds_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang stamps `weight_version` when it emits an output, so the final chunk of a
    pause-aborted round can carry the version the swap just loaded. Its tokens were
    generated before the pause: they keep the round's version. (A scripted stream: a
    real backend cannot be made to emit this late on demand.)"""

    def chunk(ids: list[int], version: str, finish: FinishReason | None) -> GenerateResponse:
        return GenerateResponse(
            output_ids=ids,
            meta_info=MetaInfo(
                id="r",
                finish_reason=finish,
                weight_version=version,
                prompt_tokens=4,
                completion_tokens=len(ids),
                output_token_logprobs=[(-0.5, i, None) for i in ids],
            ),
        )

    rounds = iter(
        [
            [
                chunk([1], "3", None),
                chunk([1, 2], "3", None),
                chunk([1, 2, 3, 4], "4", FinishReason("abort")),
            ],  # emitted after the swap
            [chunk([5], "4", None), chunk([5, 6], "4", FinishReason("length", length=6))],
        ]
    )

    async def scripted(
        _: TokenRequest,
        *,
        coalesce: bool = False,  # noqa: ANN202
        new_only: bool = False,
        routing_key: str | None = None,
    ):
        for item in next(rounds):
            yield item

    client = SGLangClient("http://127.0.0.1:9", resubmit_wait_s=0)
    monkeypatch.setattr(client, "generate_stream", scripted)
    deltas = [d async for d in client.generate_interruptible_stream(req(6))]
    ids = [i for d in deltas for i in d.output_ids]
    versions = [v for d in deltas for v in d.output_versions]
    assert ids == [1, 2, 3, 4, 5, 6]
    assert versions == [3, 3, 3, 3, 4, 4]
    assert deltas[-1].finish_reason is not None and deltas[-1].resubmissions == 1
