"""A fast SGLang-protocol echo backend: the fake at the network edge for the gateway
overhead benchmark and for failure-path tests (never a stand-in for the real engine).
It reads and writes the bodies of `areal_service/sglang_protocol.py`, the same models the
gateway's client and the local engine use; no torch, no FastAPI.

A raw asyncio HTTP/1.1 keep-alive server: server CPU per non-streaming /generate at 64
concurrent was 0.108 ms (uvloop), 0.138 ms (asyncio) vs 0.145 ms for uvicorn+httptools
with a minimal ASGI app, so no framework. It speaks the `/generate` subset of
SGLang's native API (cumulative SSE streams, logprob triples, `weight_version`) and the
control endpoints (pause modes, continue, update_weights_from_disk, abort, flush).

Output token at absolute position p (prompt length + index) is
`100 + (input_ids[0] * 31 + 7 * p) % 30000`, so a request resubmitted with its partial
output appended continues the exact same sequence. Run:
`python -m engine.echo_backend --port P [--tokens 32] [--delay-ms 0] [--token-delay-ms 0]`.
Per-request test hook (top-level key): `echo_error_after: k` ends the stream with a
`data: {"error": ...}` event after k tokens (400 when not streaming).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from areal_service.sglang_protocol import (
    ABORT_REQUEST,
    BEGIN_WEIGHT_UPDATE,
    CONTINUE_GENERATION,
    DESTROY_WEIGHTS_UPDATE_GROUP,
    END_WEIGHT_UPDATE,
    FLUSH_CACHE,
    GENERATE,
    HEALTH,
    INIT_WEIGHTS_UPDATE_GROUP,
    MODEL_INFO,
    PAUSE_GENERATION,
    SERVER_INFO,
    UPDATE_WEIGHTS_FROM_DISK,
    UPDATE_WEIGHTS_FROM_DISTRIBUTED,
    AbortRequest,
    ErrorDetail,
    ErrorResponse,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    MetaInfo,
    ModelInfo,
    PauseRequest,
    ServerInfo,
    StatusMessage,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsResponse,
)

EOS_ID = 1
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}

_M = TypeVar("_M", bound=BaseModel)
Emit = Callable[[GenerateResponse | ErrorResponse], Awaitable[None]]


def echo_token(first_input_id: int, position: int) -> int:
    """The token the echo backend emits at absolute `position` (never EOS_ID)."""
    return 100 + (first_input_id * 31 + 7 * position) % 30000


def echo_logprob(position: int) -> float:
    """The fake behaviour logprob at absolute `position` (always < 0)."""
    return -0.01 * (1 + position % 50)


@dataclass
class EchoSettings:
    tokens: int = 32
    """Tokens a request generates when `max_new_tokens` is larger (ends with EOS_ID)."""
    delay_ms: float = 0.0
    """Sleep before the first token of every request."""
    token_delay_ms: float = 0.0
    """Sleep before each token (makes streams slow enough to interrupt)."""
    load_delay_ms: float = 0.0
    """How long `/update_weights_from_disk` takes."""
    disconnect_abort_ms: float = 2000.0
    """A stream whose client went away is aborted this much later (as SGLang does), so
    only an explicit `/abort_request` stops it at once."""
    stream_interval: int = 1
    """A streamed request emits a chunk for its first token and then every this many
    tokens (SGLang's `--stream-interval`); the finish chunk always."""
    legacy_info: bool = False
    """Serve only `/get_model_info` / `/get_server_info` (404 on the new names)."""
    weight_version: str = "default"


@dataclass
class _Running:
    rid: str
    aborted: bool = False
    produced: int = 0
    """Tokens generated so far (tests wait on it instead of sleeping)."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def abort(self) -> None:
        self.aborted = True
        self.wake.set()

    async def sleep(self, seconds: float) -> None:
        """Sleep, returning early when aborted."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), seconds)


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class EchoBackend:
    """State and endpoint handlers; one instance per server (one event loop)."""

    def __init__(self, settings: EchoSettings) -> None:
        self.settings = settings
        self.weight_version = settings.weight_version
        self.paused = False
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.running: dict[str, _Running] = {}
        self.healthy = True
        self.calls: list[str] = []
        """Paths of control calls, in order (tests assert pause/continue pairing)."""

    # -- /generate ---------------------------------------------------------------------
    async def generate(
        self, body: GenerateRequest, emit: Emit | None
    ) -> GenerateResponse | ErrorResponse:
        """Generate for `body` (its `rid` set); with `emit`, every chunk is also emitted."""
        ids = body.input_ids
        if not ids or not all(isinstance(i, int) for i in ids):
            raise HttpError(400, "input_ids must be a non-empty list of ints")
        max_new = body.sampling_params.max_new_tokens
        rid = str(body.rid)
        if rid in self.running:
            raise HttpError(400, f"Duplicate request ID detected: {rid}")
        t0 = time.perf_counter()
        await self.resumed.wait()  # new requests block while paused (any mode)
        run = _Running(rid)
        self.running[rid] = run
        try:
            return await self._decode(
                body, body.prompt_ids, 128 if max_new is None else max_new, run, emit, t0
            )
        finally:
            del self.running[rid]

    async def _decode(
        self,
        body: GenerateRequest,
        ids: list[int],
        max_new: int,
        run: _Running,
        emit: Emit | None,
        t0: float,
    ) -> GenerateResponse | ErrorResponse:
        s = self.settings
        n = min(s.tokens, max_new)
        hits_length = max_new <= s.tokens
        error_after = (body.model_extra or {}).get("echo_error_after")
        out: list[int] = []
        if s.delay_ms:
            await run.sleep(s.delay_ms / 1000)
        finish: FinishReason | None = None
        for i in range(n):
            if s.token_delay_ms and not run.aborted:
                await run.sleep(s.token_delay_ms / 1000)
            if self.paused and not run.aborted:  # retract / in_place: hold the request
                await self._hold(run)
            if run.aborted:
                break
            if i == error_after:  # test hook: a mid-stream ValueError
                return await self._fail(emit, "echo_error_after reached")
            last = i == n - 1
            out.append(EOS_ID if last and not hits_length else echo_token(ids[0], len(ids) + i))
            run.produced = len(out)
            if last:
                finish = (
                    FinishReason("length", length=n)
                    if hits_length
                    else FinishReason("stop", matched=EOS_ID)
                )
            elif emit is not None and (i == 0 or (i + 1) % s.stream_interval == 0):
                await emit(self._chunk(body, ids, out, None, None))
        if run.aborted:
            finish = FinishReason("abort", message="Aborted")
        if finish is None:  # max_new_tokens == 0
            finish = FinishReason("length", length=0)
        final = self._chunk(body, ids, out, finish, time.perf_counter() - t0)
        if emit is not None:
            await emit(final)
        return final

    async def _fail(self, emit: Emit | None, message: str) -> ErrorResponse:
        error = ErrorResponse(
            error=ErrorDetail(
                message=message, type="invalid_request_error", code=400, retryable=False
            )
        )
        if emit is None:
            raise HttpError(400, message)
        await emit(error)
        return error

    async def _hold(self, run: _Running) -> None:
        """Wait for continue_generation or an abort of this request, whichever is first."""
        waits = [asyncio.ensure_future(self.resumed.wait()), asyncio.ensure_future(run.wake.wait())]
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()

    def _chunk(
        self,
        body: GenerateRequest,
        ids: list[int],
        out: list[int],
        finish: FinishReason | None,
        latency: float | None,
    ) -> GenerateResponse:
        base = len(ids)
        logprobs = (
            [(echo_logprob(base + i), t, None) for i, t in enumerate(out)]
            if body.return_logprob
            else None
        )
        return GenerateResponse(
            text=" ".join(f"t{t}" for t in out if t != EOS_ID),
            output_ids=list(out),
            meta_info=MetaInfo(
                id=str(body.rid),
                finish_reason=finish,
                prompt_tokens=base,
                completion_tokens=len(out),
                weight_version=self.weight_version,
                output_token_logprobs=logprobs,
                e2e_latency=latency,
            ),
        )

    # -- control -----------------------------------------------------------------------
    async def pause(self, body: PauseRequest) -> StatusMessage:
        self.calls.append("pause_generation")
        self.paused = True
        self.resumed.clear()
        if body.mode == "abort":
            aborted = list(self.running.values())
            for run in aborted:
                run.abort()
            # Like SGLang's scheduler, answer only once the aborted requests have emitted
            # their final output: it carries the weight version that produced their
            # tokens, not the one a swap right after this pause loads.
            deadline = time.monotonic() + 5
            while any(r.rid in self.running for r in aborted) and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
        return StatusMessage(message="Generation paused successfully.")

    def resume(self) -> StatusMessage:
        self.calls.append("continue_generation")
        self.paused = False
        self.resumed.set()
        return StatusMessage(message="Generation continued successfully.")

    async def update_weights(
        self, body: UpdateWeightsFromDiskRequest
    ) -> tuple[int, UpdateWeightsResponse]:
        self.calls.append("update_weights_from_disk")
        if not body.model_path:
            raise HttpError(400, "model_path is required")
        if not self.paused:  # the writer lock waits for in-flight requests to finish
            while self.running:
                await asyncio.sleep(0.005)
        if self.settings.load_delay_ms:
            await asyncio.sleep(self.settings.load_delay_ms / 1000)
        if not Path(body.model_path).exists():
            return 400, UpdateWeightsResponse(
                success=False, message=f"Failed to update weights: {body.model_path} does not exist"
            )
        message = "Succeeded to update model weights."
        if body.weight_version is not None:
            self.weight_version = body.weight_version
            message += f" Weight version updated to {self.weight_version}."
        return 200, UpdateWeightsResponse(success=True, message=message)

    def abandon(self, rid: str) -> None:
        """The client of `rid` disconnected: abort it after the grace period."""

        def abort() -> None:
            if (run := self.running.get(rid)) is not None:
                run.abort()

        asyncio.get_running_loop().call_later(self.settings.disconnect_abort_ms / 1000, abort)

    def abort_request(self, body: AbortRequest) -> None:
        for run in self.running.values():
            if body.abort_all or (body.rid and run.rid.startswith(body.rid)):
                run.abort()

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model_path="echo",
            tokenizer_path="echo",
            is_generation=True,
            weight_version=self.weight_version,
            model_type="echo",
            architectures=["EchoForCausalLM"],
        )

    def server_info(self) -> ServerInfo:
        return ServerInfo(
            served_model_name="echo",
            version="echo-0",
            weight_version=self.weight_version,
            internal_states=[{"running": len(self.running)}],
            paused=self.paused,
        )  # an extra key, as SGLang's own vary


# -- HTTP/1.1 --------------------------------------------------------------------------
def _head(status: int, content_type: str, length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"Content-Type: {content_type}\r\n{framing}\r\n\r\n"
    ).encode()


def _json_response(status: int, obj: BaseModel) -> bytes:
    body = obj.model_dump_json(exclude_none=isinstance(obj, ErrorResponse)).encode()
    return _head(status, "application/json", len(body)) + body


class _Server:
    """Serves one EchoBackend on one event loop; tracks connections so stop() is exact."""

    def __init__(self, backend: EchoBackend) -> None:
        self.backend = backend
        self.server: asyncio.Server | None = None
        self.conns: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._conn, host, port, backlog=1024)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in list(self.conns):
            task.cancel()
        await asyncio.gather(*self.conns, return_exceptions=True)

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.conns.add(task)
        try:
            while await self._one(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self.conns.discard(task)
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        request_line = lines[0].split(" ", 2)
        if len(request_line) != 3:  # e.g. a router's bare connection probe
            writer.write(_json_response(400, _error(f"malformed request line {lines[0]!r}")))
            await writer.drain()
            return False
        method, target, _ = request_line
        headers = {}
        for line in lines[1:]:
            if line:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = await _read_chunked(reader)
        else:
            body = await reader.readexactly(int(headers.get("content-length", 0)))
        path = target.partition("?")[0]
        try:
            await self._dispatch(method, path, body, writer)
        except HttpError as e:
            writer.write(_json_response(e.status, _error(e.message)))
        except (ValueError, TypeError, AttributeError) as e:  # malformed body fields
            writer.write(_json_response(400, _error(f"{type(e).__name__}: {e}")))
        await writer.drain()
        return headers.get("connection", "").lower() != "close"

    async def _dispatch(
        self, method: str, path: str, raw: bytes, writer: asyncio.StreamWriter
    ) -> None:
        """Route one request; bodies are parsed into the protocol models (a malformed
        one raises ValueError: 400)."""
        b = self.backend
        if path == GENERATE.path:
            body = GenerateRequest.model_validate_json(raw or b"{}")
            if not body.rid:
                body = body.model_copy(update={"rid": f"echo-{time.monotonic_ns()}"})
            if body.stream:
                await self._stream(body, writer)
            else:
                writer.write(_json_response(200, await b.generate(body, None)))
        elif path in (HEALTH.path, "/health_generate"):
            writer.write(_head(200 if b.healthy else 503, "text/plain", 0))
        elif path in (MODEL_INFO.path, MODEL_INFO.legacy_path):
            if b.settings.legacy_info == (path == MODEL_INFO.path):
                raise HttpError(404, "Not Found")
            writer.write(_json_response(200, b.model_info()))
        elif path in (SERVER_INFO.path, SERVER_INFO.legacy_path):
            if b.settings.legacy_info == (path == SERVER_INFO.path):
                raise HttpError(404, "Not Found")
            writer.write(_json_response(200, b.server_info()))
        elif path == PAUSE_GENERATION.path:
            writer.write(_json_response(200, await b.pause(_parse(PauseRequest, raw))))
        elif path == CONTINUE_GENERATION.path:
            writer.write(_json_response(200, b.resume()))
        elif path == UPDATE_WEIGHTS_FROM_DISK.path:
            status, result = await b.update_weights(_parse(UpdateWeightsFromDiskRequest, raw))
            writer.write(_json_response(status, result))
        elif path in (
            INIT_WEIGHTS_UPDATE_GROUP.path,
            UPDATE_WEIGHTS_FROM_DISTRIBUTED.path,
            DESTROY_WEIGHTS_UPDATE_GROUP.path,
            BEGIN_WEIGHT_UPDATE.path,
            END_WEIGHT_UPDATE.path,
        ):
            # No torch here, so no group to join: refused, and the gateway's syncer
            # swaps such a backend from disk (the trainer's copy).
            writer.write(
                _json_response(
                    400,
                    UpdateWeightsResponse(
                        success=False, message="the echo backend holds no weights to broadcast into"
                    ),
                )
            )
        elif path == ABORT_REQUEST.path:
            b.abort_request(_parse(AbortRequest, raw))
            writer.write(_head(200, "application/json", 0))
        elif path == FLUSH_CACHE.path:
            if b.running and not b.paused:
                raise HttpError(400, "Cache not flushed: there are running requests")
            text = b"Cache flushed.\nPlease check backend logs for more details."
            writer.write(_head(200, "text/plain", len(text)) + text)
        else:
            raise HttpError(404, f"{method} {path} not found")

    async def _stream(self, body: GenerateRequest, writer: asyncio.StreamWriter) -> None:
        started = gone = False
        rid = str(body.rid)

        async def emit(chunk: GenerateResponse | ErrorResponse) -> None:
            nonlocal started, gone
            if gone:
                return
            if not started:
                writer.write(_head(200, "text/event-stream", None))
                started = True
            data = b"data: " + chunk.model_dump_json().encode() + b"\n\n"
            try:
                if writer.is_closing():
                    raise ConnectionResetError
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
            except ConnectionError:
                gone = True
                self.backend.abandon(rid)

        await self.backend.generate(body, emit)  # HttpError before the first chunk: 400
        if gone:
            raise ConnectionResetError
        done = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


def _parse(model: type[_M], raw: bytes) -> _M:
    """A control body (`{}` when empty), as its protocol model."""
    return model.model_validate_json(raw if raw.strip() else b"{}")


def _error(message: str) -> ErrorResponse:
    return ErrorResponse(error=ErrorDetail(message=message))


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


# -- handles ---------------------------------------------------------------------------
class EchoBackendHandle:
    """A running echo backend. `.backend` is the live state (thread mode only); stop()
    stops exactly the thread or subprocess this handle started."""

    def __init__(
        self,
        url: str,
        *,
        backend: EchoBackend | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        thread: threading.Thread | None = None,
        server: _Server | None = None,
        proc: subprocess.Popen[str] | None = None,
    ) -> None:
        self.url = url
        self.port = int(url.rsplit(":", 1)[1])
        self.backend = backend
        self._loop, self._thread, self._server, self._proc = loop, thread, server, proc

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the backend's loop (thread mode) and return its result."""
        assert self._loop is not None, "call() needs a thread-mode backend"

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(5)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
            return
        assert self._loop is not None and self._server is not None and self._thread
        fut = asyncio.run_coroutine_threadsafe(self._server.stop(), self._loop)
        fut.result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> EchoBackendHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_echo_backend(
    port: int = 0, *, host: str = "127.0.0.1", subprocess_mode: bool = False, **settings: Any
) -> EchoBackendHandle:
    """Start an echo backend on `host:port` (0: a free port) in a daemon thread with its
    own event loop, or in a child process (`subprocess_mode`, for benchmarks, so its CPU
    is not counted against the client). `settings` are `EchoSettings` fields."""
    if subprocess_mode:
        return _start_subprocess(port, host, EchoSettings(**settings))
    backend_box: list[Any] = []
    ready = threading.Event()
    loop = asyncio.new_event_loop()

    def run() -> None:
        asyncio.set_event_loop(loop)
        backend = EchoBackend(EchoSettings(**settings))
        server = _Server(backend)
        bound = loop.run_until_complete(server.start(host, port))
        backend_box.extend([backend, server, bound])
        ready.set()
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=run, name=f"echo-backend-{port}", daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("echo backend did not start within 10 s")
    backend, server, bound = backend_box
    return EchoBackendHandle(
        f"http://{host}:{bound}", backend=backend, loop=loop, thread=thread, server=server
    )


def _start_subprocess(port: int, host: str, s: EchoSettings) -> EchoBackendHandle:
    cmd = [
        sys.executable,
        "-m",
        "engine.echo_backend",
        "--host",
        host,
        "--port",
        str(port),
        "--tokens",
        str(s.tokens),
        "--delay-ms",
        str(s.delay_ms),
        "--token-delay-ms",
        str(s.token_delay_ms),
        "--load-delay-ms",
        str(s.load_delay_ms),
        "--disconnect-abort-ms",
        str(s.disconnect_abort_ms),
        "--stream-interval",
        str(s.stream_interval),
    ]
    if s.legacy_info:
        cmd.append("--legacy-info")
    proc = subprocess.Popen(
        cmd, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "echo backend listening on http://host:port"
    if "listening on " not in line:
        proc.kill()
        proc.wait(5)
        raise RuntimeError(f"echo backend failed to start: {line!r}")
    return EchoBackendHandle(line.split("listening on ", 1)[1].strip(), proc=proc)


async def _main(args: argparse.Namespace) -> None:
    settings = EchoSettings(
        tokens=args.tokens,
        delay_ms=args.delay_ms,
        token_delay_ms=args.token_delay_ms,
        load_delay_ms=args.load_delay_ms,
        legacy_info=args.legacy_info,
        disconnect_abort_ms=args.disconnect_abort_ms,
        stream_interval=args.stream_interval,
    )
    server = _Server(EchoBackend(settings))
    port = await server.start(args.host, args.port)
    # The handshake line a parent in subprocess mode waits for (stdout, not a log).
    sys.stdout.write(f"echo backend listening on http://{args.host}:{port}\n")
    sys.stdout.flush()
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--token-delay-ms", type=float, default=0.0)
    p.add_argument("--load-delay-ms", type=float, default=0.0)
    p.add_argument("--disconnect-abort-ms", type=float, default=2000.0)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--legacy-info", action="store_true")
    p.add_argument("--no-uvloop", action="store_true")
    args = p.parse_args()
    run: Callable[[Awaitable[None]], None] = asyncio.run  # type: ignore[assignment]
    if not args.no_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            run = uvloop.run
    with contextlib.suppress(KeyboardInterrupt):
        run(_main(args))


if __name__ == "__main__":
    main()
