"""SGLangClient: the only code that talks to SGLang-protocol backends (SGLang servers and
the local engine), one thin named method per endpoint, plus interruptible generation
and the weight swap. Imports nothing from the store, the routes or the trainer.

The swap sequence and how `generate_interruptible*` resubmit the requests it aborts:
`gateway/interruptible.py`. Every endpoint and field used, the wire models and the
SGLang versions they were checked against: `areal_service/sglang_protocol.py`.
`RouterClient` is the same client pointed at SGLang's router (`gateway.router.url`):
`/generate` through it (the session as `X-SMG-Routing-Key`), aborts to every worker.

HTTP client, chosen by measurement (`python -m benchmarks.http_client_choice`): 2-core
box shared with other jobs, uvloop, 64 concurrent `/generate` (64 ids in, 32 ids +
logprobs out) against the echo backend in a child process; client-process CPU ms per
request (req/s is noisy on a shared box; CPU/request is the number that matters):

    client                          req/s  no-stream  stream(33 chunks)  backend +100ms
    httpx default AsyncClient         291       2.19       2.29               1.61
    httpx tuned limits (64 conns)      72      11.07      10.23              14.68
    httpx 8 sharded pools             554       1.80       1.90               1.67
    httpx2 tuned limits               740       1.04       1.87               1.21
    aiohttp TCPConnector             2199       0.20       0.82               0.23
    raw asyncio keep-alive           3742       0.07       0.52               0.11
    SGLangClient on aiohttp (before) 1703       0.25       1.04               0.31

httpcore's pool bookkeeping grows with open connections (the tuned 64-connection pool
is the worst); aiohttp stays flat (0.24 ms at 256 concurrent). So: aiohttp, one
`ClientSession` + `TCPConnector` per client, for the control calls. The one hot call,
`/generate`, goes through `gateway/http1.py` (httptools' parser on an asyncio protocol):
0.10 ms per non-streamed request including the typed parse, against 0.23 ms on aiohttp,
because the gateway's event loop is its bottleneck.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import BaseModel, ValidationError

from areal_service.sglang_protocol import (
    ABORT_REQUEST,
    CONTINUE_GENERATION,
    DESTROY_WEIGHTS_UPDATE_GROUP,
    FLUSH_CACHE,
    GENERATE,
    HEALTH,
    INIT_WEIGHTS_UPDATE_GROUP,
    LOAD_LORA_ADAPTER,
    MODEL_INFO,
    PAUSE_GENERATION,
    ROUTER_READINESS,
    ROUTER_WORKERS,
    ROUTING_KEY_HEADER,
    SERVER_INFO,
    UNLOAD_LORA_ADAPTER,
    UPDATE_WEIGHTS_FROM_DISK,
    UPDATE_WEIGHTS_FROM_DISTRIBUTED,
    AbortRequest,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    Endpoint,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterRequest,
    LoRAUpdateResponse,
    ModelInfo,
    PauseMode,
    PauseRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsResponse,
    router_worker_urls,
)
from gateway import interruptible
from gateway.adapters import AdapterNames, Lease, served_name

# `X as X`: re-exported (callers import them from here), which strict mypy wants explicit.
from gateway.backend_errors import BackendError as BackendError
from gateway.backend_errors import BackendUnavailable as BackendUnavailable
from gateway.http1 import ConnectFailed, Http1Pool
from gateway.interruptible import Generation as Generation
from gateway.interruptible import GenerationDelta as GenerationDelta
from gateway.stream_parse import ErrorEvent, StreamParser, SuffixParser, WholeChunks

log = logging.getLogger(__name__)
_JSON = {"Content-Type": "application/json"}
_UNLOAD_POLL_S = 0.25
"""How often a retired adapter name's unload task checks whether it drained."""
_KEEPALIVE_S = 4.0  # below uvicorn's 5 s keep-alive (SGLang's server), so a pooled
# connection is never reused just as the server closes it.


@dataclass(frozen=True, slots=True)
class SwapTimings:
    """Seconds spent in each phase of one backend's weight swap."""

    pause_s: float
    update_s: float
    continue_s: float
    total_s: float


class SGLangClient:
    """Client of one SGLang-protocol backend; one aiohttp session per client, created
    lazily on the running loop. Call `aclose()` (or use `async with`) when done."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        control_timeout_s: float = 60.0,
        max_connections: int = 1024,
        api_key: str | None = None,
        max_resubmissions: int = 50,
        resubmit_wait_s: float = 0.05,
        adapters: AdapterNames | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.adapters = adapters
        """Versioned adapter names (`gateway/adapters.py`) on a server that loads LoRA
        adapters by name (vLLM, SGLang with `trainer.lora`); None: the local engine,
        which versions its adapters itself, or no LoRA."""
        self._unloads: set[asyncio.Task[None]] = set()
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.control_timeout_s = control_timeout_s
        self.max_connections = max_connections
        self.max_resubmissions = max_resubmissions
        self.resubmit_wait_s = resubmit_wait_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._pool: Http1Pool | None = None
        self._background: set[asyncio.Task[None]] = set()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self.max_connections, limit_per_host=0, keepalive_timeout=_KEEPALIVE_S
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(
                    total=self.timeout_s, sock_connect=self.connect_timeout_s
                ),
            )
        return self._session

    def _generate_pool(self) -> Http1Pool:
        """The lean keep-alive pool for `/generate` (see `gateway/http1.py` for why)."""
        if self._pool is None:
            self._pool = Http1Pool(
                self.base_url,
                max_connections=self.max_connections,
                connect_timeout_s=self.connect_timeout_s,
                keepalive_s=_KEEPALIVE_S,
                headers=self._headers,
            )
        return self._pool

    async def aclose(self) -> None:
        """Wait for pending fire-and-forget aborts, then close the HTTP connections."""
        for task in self._unloads:  # retired adapters wait for a drain: not worth waiting for
            task.cancel()
        if self._background or self._unloads:
            await asyncio.gather(*self._background, *self._unloads, return_exceptions=True)
        if self._pool is not None:
            self._pool.close()
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- transport ---------------------------------------------------------------------
    def _unavailable(self, exc: BaseException) -> BackendUnavailable:
        refused = isinstance(
            exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError | ConnectFailed
        )
        return BackendUnavailable(
            f"{type(exc).__name__}: {exc}", url=self.base_url, sent=not refused
        )

    def _error(self, status: int, raw: bytes) -> BackendError:
        """The error of a non-2xx reply: SGLang's `{"error": {"message"}}`, else the text."""
        try:
            message = ErrorResponse.model_validate_json(raw).error.message
        except ValidationError:
            message = raw.decode("utf-8", "replace")[:2000]
        if status == 503:
            return BackendUnavailable(message, url=self.base_url)
        return BackendError(status, message, url=self.base_url)

    def _malformed(self, endpoint: Endpoint, exc: ValidationError) -> BackendError:
        """A 2xx reply that does not have the shape `sglang_protocol` expects: 502."""
        return BackendError(502, f"malformed {endpoint.path} reply: {exc}", url=self.base_url)

    async def _call(
        self,
        endpoint: Endpoint,
        body: BaseModel | None = None,
        *,
        path: str | None = None,
        timeout_s: float | None = None,
    ) -> bytes:
        """One control request/response (`path` overrides the endpoint's, for legacy
        names); raises BackendError / BackendUnavailable, else the reply body."""
        timeout = aiohttp.ClientTimeout(
            total=timeout_s or self.timeout_s, sock_connect=self.connect_timeout_s
        )
        data = None if body is None else body.model_dump_json(exclude_unset=True).encode()
        headers = None if data is None else _JSON
        try:
            async with self._http().request(
                endpoint.method,
                self.base_url + (path or endpoint.path),
                data=data,
                headers=headers,
                timeout=timeout,
            ) as r:
                raw = await r.read()
                status = r.status
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as e:
            raise self._unavailable(e) from e
        if status >= 400:
            raise self._error(status, raw)
        return raw

    def _abort_soon(self, rid: str) -> None:
        """Fire-and-forget `/abort_request` for a request its caller gave up on."""

        async def abort() -> None:
            try:
                await self.abort_request(rid)
            except BackendError as e:
                log.warning("abort of %s failed: %s", rid, e)

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- the engine's wire format (a client of another engine overrides these) ----------
    def _generate_body(self, payload: GenerateRequest, *, stream: bool) -> tuple[str, bytes]:
        """Path and body of the token-in generate call for `payload`."""
        return GENERATE.path, payload.to_json_bytes(stream=stream)

    def _generate_reply(self, raw: bytes, payload: GenerateRequest) -> GenerateResponse:
        """A non-streamed reply, parsed (ValidationError when malformed)."""
        return GenerateResponse.model_validate_json(raw)

    def _stream_parser(self, payload: GenerateRequest, new_only: bool) -> StreamParser:
        """Parser of one stream's SSE payloads (see `generate_stream`)."""
        return SuffixParser() if new_only else WholeChunks()

    # -- endpoints ---------------------------------------------------------------------
    def _adapter_policy(self, payload: GenerateRequest) -> str | None:
        """The policy whose versioned adapter `payload` runs under (None: not leased)."""
        names = self.adapters
        if names is None:
            return None
        return payload.lora_path or names.default_policy

    async def generate(
        self, payload: GenerateRequest, *, routing_key: str | None = None
    ) -> GenerateResponse:
        """Non-streaming `POST /generate`. Cancelling the caller aborts the request.
        `routing_key`: sent as `X-SMG-Routing-Key` (session affinity through SGLang's
        router; a server ignores it). With versioned adapters (`self.adapters`), a
        policy's request is sent under the name serving it now, counted while it runs,
        and its tokens carry that name's version."""
        if self.adapters is not None and (policy := self._adapter_policy(payload)) is not None:
            lease = self.adapters.acquire(policy)
            try:
                reply = await self._generate(_on_adapter(payload, lease), routing_key)
            finally:
                self.adapters.release(lease)
            return _tagged(reply, lease)
        return await self._generate(payload, routing_key)

    async def _generate(
        self, payload: GenerateRequest, routing_key: str | None
    ) -> GenerateResponse:
        path, body = self._generate_body(payload, stream=False)
        rid = str(payload.rid)
        try:
            async with self._generate_pool().post(
                path, body, timeout_s=self.timeout_s, headers=_routing_header(routing_key)
            ) as r:
                raw = await r.read()
                status = r.status
        except asyncio.CancelledError:
            self._abort_soon(rid)
            raise
        except (OSError, TimeoutError) as e:
            unavailable = self._unavailable(e)
            if unavailable.sent:  # e.g. a timeout: the backend may still be generating
                self._abort_soon(rid)
            raise unavailable from e
        if status >= 400:
            raise self._error(status, raw)
        try:
            return self._generate_reply(raw, payload)
        except ValidationError as e:
            raise self._malformed(GENERATE, e) from e

    def generate_stream(
        self,
        payload: GenerateRequest,
        *,
        coalesce: bool = False,
        new_only: bool = False,
        routing_key: str | None = None,
    ) -> AsyncGenerator[GenerateResponse, None]:
        """Streaming `POST /generate` (`_generate_stream`); a policy's request on
        versioned adapters is leased as in `generate`."""
        if self.adapters is not None and (policy := self._adapter_policy(payload)) is not None:
            return self._leased_stream(payload, policy, coalesce, new_only, routing_key)
        return self._generate_stream(
            payload, coalesce=coalesce, new_only=new_only, routing_key=routing_key
        )

    async def _leased_stream(
        self,
        payload: GenerateRequest,
        policy: str,
        coalesce: bool,
        new_only: bool,
        routing_key: str | None,
    ) -> AsyncGenerator[GenerateResponse, None]:
        assert self.adapters is not None
        lease = self.adapters.acquire(policy)
        try:
            async with contextlib.aclosing(
                self._generate_stream(
                    _on_adapter(payload, lease),
                    coalesce=coalesce,
                    new_only=new_only,
                    routing_key=routing_key,
                )
            ) as chunks:
                async for chunk in chunks:
                    yield _tagged(chunk, lease)
        finally:
            self.adapters.release(lease)

    async def _generate_stream(
        self,
        payload: GenerateRequest,
        *,
        coalesce: bool = False,
        new_only: bool = False,
        routing_key: str | None = None,
    ) -> AsyncGenerator[GenerateResponse, None]:
        """Streaming `POST /generate`: one result per SSE `data:` chunk, through the
        finish chunk and `[DONE]`. A `data: {"error":…}` event raises BackendError.
        Closing the iterator early (client gone) or cancelling aborts the request.

        `coalesce`: when one network read holds several CUMULATIVE chunks (the caller
        fell behind), yield only the newest: it contains the others. Under load this
        turns N JSON parses and N downstream writes into one; incremental chunks
        (`--incremental-streaming-output`) are always yielded one by one.

        `new_only`: a cumulative chunk is cut to what is new before it is parsed
        (`SuffixParser`): its `output_ids` and logprobs hold only the tokens after the
        previous chunk's (so `cumulative` is False from the second chunk on), and the
        parse costs O(new tokens), not O(tokens so far)."""
        path, body = self._generate_body(payload, stream=True)
        done = False
        parser = self._stream_parser(payload, new_only)
        try:
            async with self._generate_pool().post(
                path, body, timeout_s=self.timeout_s, headers=_routing_header(routing_key)
            ) as r:
                if r.status >= 400:
                    done = True  # rejected before it started
                    raise self._error(r.status, await r.read())
                buf = b""
                while True:  # SSE `data:` payloads, a list per network read
                    piece = await r.next_piece()
                    if piece is None:
                        batch = [buf[5:].strip()] if buf.startswith(b"data:") else []
                        buf = b""
                        if not batch:
                            break
                    else:
                        buf += piece
                        *lines, buf = buf.split(b"\n")
                        batch = [line[5:].strip() for line in lines if line.startswith(b"data:")]
                        if not batch:
                            continue
                    try:
                        chunks = parser.chunks(batch, coalesce)
                    except ValidationError as e:
                        raise self._malformed(GENERATE, e) from e
                    for chunk in chunks:
                        if chunk is None:
                            done = True
                            return
                        if isinstance(chunk, ErrorEvent):  # the request ended with an error
                            done = True
                            raise BackendError(chunk.status, chunk.message, url=self.base_url)
                        yield chunk
            raise BackendUnavailable("stream ended without [DONE]", url=self.base_url)
        except (OSError, TimeoutError) as e:
            unavailable = self._unavailable(e)
            done = not unavailable.sent  # never reached the backend: nothing to abort
            raise unavailable from e
        finally:
            if not done:
                self._abort_soon(str(payload.rid))

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Pause; `abort` ends in-flight requests with finish_reason abort."""
        await self._call(
            PAUSE_GENERATION, PauseRequest(mode=mode), timeout_s=self.control_timeout_s
        )

    async def continue_generation(self) -> None:
        await self._call(
            CONTINUE_GENERATION, ContinueGenerationRequest(), timeout_s=self.control_timeout_s
        )

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        *,
        flush_cache: bool = True,
        lora_name: str | None = None,
    ) -> str:
        """Load HF weights from `model_path` (same architecture); returns the message.
        Raises BackendError on `success: false`. Uses the long timeout (disk loads).
        `lora_name`: a named policy's adapter (the local engine's extension)."""
        body = UpdateWeightsFromDiskRequest(
            model_path=model_path,
            flush_cache=flush_cache,
            **({} if weight_version is None else {"weight_version": weight_version}),
            **({} if lora_name is None else {"lora_name": lora_name}),
        )
        raw = await self._call(UPDATE_WEIGHTS_FROM_DISK, body)
        try:
            result = UpdateWeightsResponse.model_validate_json(raw)
        except ValidationError as e:
            raise self._malformed(UPDATE_WEIGHTS_FROM_DISK, e) from e
        if not result.success:
            raise BackendError(400, result.message, url=self.base_url)
        return result.message

    async def _weights_call(self, endpoint: Endpoint, body: BaseModel) -> str:
        """A weight-update control call answered `{success, message}`; BackendError on
        `success: false`. Uses the long timeout (it waits on the trainer)."""
        raw = await self._call(endpoint, body)
        try:
            result = UpdateWeightsResponse.model_validate_json(raw)
        except ValidationError as e:
            raise self._malformed(endpoint, e) from e
        if not result.success:
            raise BackendError(400, result.message, url=self.base_url)
        return result.message

    async def init_weights_update_group(self, body: InitWeightsUpdateGroupRequest) -> str:
        """Join the trainer's weight-update group; returns once every rank joined."""
        return await self._weights_call(INIT_WEIGHTS_UPDATE_GROUP, body)

    async def update_weights_from_distributed(
        self, body: UpdateWeightsFromDistributedRequest
    ) -> str:
        """Receive one bucket broadcast by the trainer (which must be sending meanwhile)."""
        return await self._weights_call(UPDATE_WEIGHTS_FROM_DISTRIBUTED, body)

    async def destroy_weights_update_group(self, group_name: str) -> str:
        return await self._weights_call(
            DESTROY_WEIGHTS_UPDATE_GROUP, DestroyWeightsUpdateGroupRequest(group_name=group_name)
        )

    async def abort_request(self, rid: str = "", *, abort_all: bool = False) -> None:
        """Abort by rid PREFIX (SGLang's rule), or everything with `abort_all`."""
        await self._call(
            ABORT_REQUEST,
            AbortRequest(rid=rid, abort_all=abort_all),
            timeout_s=self.control_timeout_s,
        )

    async def flush_cache(self) -> None:
        """Flush the prefix cache; BackendError(400) while requests are running."""
        await self._call(FLUSH_CACHE, timeout_s=self.control_timeout_s)

    async def model_info(self) -> ModelInfo:
        """`/model_info`, falling back to the older `/get_model_info` on 404."""
        raw = await self._get_with_fallback(MODEL_INFO)
        try:
            return ModelInfo.model_validate_json(raw)
        except ValidationError as e:
            raise self._malformed(MODEL_INFO, e) from e

    async def server_info(self) -> dict[str, Any]:
        """Every ServerArgs field plus scheduler state (shape varies by version; shown,
        never relied on, so left untyped)."""
        result: dict[str, Any] = json.loads(await self._get_with_fallback(SERVER_INFO))
        return result

    async def _get_with_fallback(self, endpoint: Endpoint, timeout_s: float | None = None) -> bytes:
        """`endpoint`, or its older path when the server answers 404 (older versions)."""
        timeout_s = self.control_timeout_s if timeout_s is None else timeout_s
        try:
            return await self._call(endpoint, timeout_s=timeout_s)
        except BackendError as e:
            if e.status != 404 or endpoint.legacy_path is None:
                raise
            return await self._call(endpoint, path=endpoint.legacy_path, timeout_s=timeout_s)

    async def health(self, timeout_s: float = 10.0) -> bool:
        """True on 200 from `/health`; False on 503, errors and timeouts."""
        try:
            await self._call(HEALTH, timeout_s=timeout_s)
        except BackendError:
            return False
        return True

    # -- composites --------------------------------------------------------------------
    async def swap_weights(
        self, model_path: str, version: int, lora_name: str | None = None
    ) -> SwapTimings:
        """pause(abort) → update_weights_from_disk → continue, continue ALWAYS sent (also
        when pause or the load fails; the load's error is re-raised after it).
        `lora_name`: swap only that policy's adapter instead, with no pause
        (`swap_adapter`); with versioned adapters (`self.adapters`) also the default
        policy's."""
        policy = lora_name if self.adapters is None else lora_name or self.adapters.default_policy
        if policy is not None:
            return await self.swap_adapter(policy, model_path, version)
        t0 = time.perf_counter()
        t1 = t2 = t0
        try:
            await self.pause_generation("abort")
            t1 = time.perf_counter()
            await self.update_weights_from_disk(model_path, str(version))
            t2 = time.perf_counter()
        finally:
            await self.continue_generation()
        t3 = time.perf_counter()
        return SwapTimings(pause_s=t1 - t0, update_s=t2 - t1, continue_s=t3 - t2, total_s=t3 - t0)

    async def swap_adapter(self, policy: str, model_path: str, version: int) -> SwapTimings:
        """Load `policy`'s version `version` (the adapter directory `model_path`) under its
        own name beside the live one, switch the policy's new requests to it, and unload
        the retired name in the background once its requests ended
        (`gateway/adapters.py`). No pause, no abort: only `update_s` is non-zero. Without
        versioned adapters (the local engine), `_swap_adapter_in_engine`. A name
        the server already holds (a gateway restarted after loading it) counts as
        loaded: the same policy and version name the same files."""
        if self.adapters is None:
            return await self._swap_adapter_in_engine(policy, model_path, version)
        t0 = time.perf_counter()
        name = served_name(policy, version)
        try:
            await self.load_lora_adapter(name, model_path)
        except BackendError as e:
            if e.status != 400 or "already" not in e.message:
                raise
        t1 = time.perf_counter()
        retired = self.adapters.switch(policy, version)
        if retired is not None:
            self._unload_when_drained(retired)
        return SwapTimings(pause_s=0.0, update_s=t1 - t0, continue_s=0.0, total_s=t1 - t0)

    def adopt_adapter(self, policy: str | None, version: int) -> None:
        """Send `policy`'s (None: the default policy's) new requests under version
        `version`, which another gateway process (the leader) loaded on this server; the
        leader also unloads the old name (after its grace, which covers this process's
        next poll). Nothing without versioned adapters."""
        if self.adapters is None:
            return
        policy = policy or self.adapters.default_policy
        if policy is None:
            return
        name = served_name(policy, version)
        if self.adapters.current(policy).served == name:
            return
        retired = self.adapters.switch(policy, version)
        if retired is not None:
            self.adapters.unloaded(retired)  # the leader's to unload

    def _unload_when_drained(self, served: str) -> None:
        """Unload the retired `served` in the background once `adapters.unloadable`
        says so (bounded by its `max_wait_s`); a failure is logged, never raised."""
        names = self.adapters
        assert names is not None

        async def unload() -> None:
            while served in names.retired() and not names.unloadable(served):
                await asyncio.sleep(_UNLOAD_POLL_S)
            if served not in names.retired():  # loaded again meanwhile: live
                return
            try:
                await self.unload_lora_adapter(served)
            except BackendError as e:
                if e.status != 404:  # 404: already gone (the server restarted)
                    log.warning("unload of adapter %s failed: %s", served, e)
            names.unloaded(served)

        task = asyncio.get_running_loop().create_task(unload())
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """SGLang's `/load_lora_adapter`: serve the adapter directory `path` as `name`."""
        await self._lora_call(
            LOAD_LORA_ADAPTER, LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
        )

    async def unload_lora_adapter(self, name: str) -> None:
        """SGLang's `/unload_lora_adapter` (it waits for the adapter's running requests)."""
        await self._lora_call(UNLOAD_LORA_ADAPTER, UnloadLoRAAdapterRequest(lora_name=name))

    async def _lora_call(self, endpoint: Endpoint, body: BaseModel) -> None:
        try:
            raw = await self._call(endpoint, body)
        except BackendError as e:  # 400 with `{success: false, error_message}`
            try:
                reply = LoRAUpdateResponse.model_validate_json(e.message)
            except ValidationError:
                raise e from None
            raise BackendError(e.status, reply.error_message or e.message, url=self.base_url) from e
        try:
            result = LoRAUpdateResponse.model_validate_json(raw)
        except ValidationError as e:
            raise self._malformed(endpoint, e) from e
        if not result.success:
            raise BackendError(400, result.error_message or "LoRA update failed", url=self.base_url)

    async def _swap_adapter_in_engine(
        self, lora_name: str, model_path: str, version: int
    ) -> SwapTimings:
        """One policy's adapter swap, as the local engine does it: a single
        `update_weights_from_disk` with `lora_name` and no pause. The engine loads it
        between two batch steps and aborts only that policy's in-flight rows, which
        interruptible generation resubmits under the new version; every other policy's
        requests run on untouched (`engine/scheduler.py`, `Scheduler._swap_adapter`).
        vLLM and SGLang serve versioned adapter names instead (`self.adapters`,
        `swap_adapter`). `lora_name` "default" (`DEFAULT_POLICY`): the
        default policy's adapter, when other policies are declared (local engine). The
        pause and continue phases are 0."""
        t0 = time.perf_counter()
        await self.update_weights_from_disk(
            model_path, str(version), flush_cache=False, lora_name=lora_name
        )
        total = time.perf_counter() - t0
        return SwapTimings(pause_s=0.0, update_s=total, continue_s=0.0, total_s=total)

    async def generate_interruptible(
        self, request: GenerateRequest, *, routing_key: str | None = None
    ) -> Generation:
        """`generate`, resubmitting on pause-aborts until a stop/length finish
        (`gateway.interruptible.generate_interruptible`)."""
        return await interruptible.generate_interruptible(self, request, routing_key=routing_key)

    def generate_interruptible_stream(
        self, request: GenerateRequest, *, routing_key: str | None = None
    ) -> AsyncGenerator[GenerationDelta, None]:
        """Streaming `generate_interruptible`: only NEW tokens per delta, across
        resubmissions (`gateway.interruptible.generate_interruptible_stream`)."""
        return interruptible.generate_interruptible_stream(self, request, routing_key=routing_key)


class RouterClient(SGLangClient):
    """Client of SGLang's router (`sglang-router`): `/generate` goes to the router, which
    picks a worker; `/abort_request`, which the router does not route, goes to every
    worker `workers()` names (a rid lives on one of them, the others ignore it). Weight
    control never goes through here: the pool sends it to each worker's own client.
    Endpoints and the versions checked: `areal_service/sglang_protocol.py`."""

    def __init__(
        self, base_url: str, workers: Callable[[], Sequence[SGLangClient]], **kwargs: Any
    ) -> None:
        super().__init__(base_url, **kwargs)
        self._workers = workers

    async def abort_request(self, rid: str = "", *, abort_all: bool = False) -> None:
        """To every healthy worker (the rid lives on one); raises only when none took it,
        so one worker being down does not fail the abort the others answered."""
        results = await asyncio.gather(
            *(w.abort_request(rid, abort_all=abort_all) for w in self._workers()),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and len(errors) == len(results):
            raise errors[0]

    async def list_workers(self) -> list[str]:
        """Base URLs of the router's workers (`GET /workers`, else the older
        `/list_workers`)."""
        raw = await self._get_with_fallback(ROUTER_WORKERS)
        try:
            listing = json.loads(raw)
        except ValueError as e:
            raise BackendError(
                502, f"malformed {ROUTER_WORKERS.path} reply: {e}", url=self.base_url
            ) from e
        if not isinstance(listing, dict):
            raise BackendError(502, f"malformed {ROUTER_WORKERS.path} reply", url=self.base_url)
        return router_worker_urls(listing)

    async def health(self, timeout_s: float = 10.0) -> bool:
        """True while the router is up and has a healthy worker (`/readiness`; `/health`
        on routers without it, which only says the router runs)."""
        try:
            await self._get_with_fallback(ROUTER_READINESS, timeout_s)
        except BackendError:
            return False
        return True


def _on_adapter(payload: GenerateRequest, lease: Lease) -> GenerateRequest:
    """`payload` sent under the lease's served name (`lora_path`; None, set explicitly:
    the base model)."""
    return payload.model_copy(update={"lora_path": lease.served})


def _tagged(reply: GenerateResponse, lease: Lease) -> GenerateResponse:
    """`reply` with the lease's version as its weight version: the server's own label is
    one per server, not per adapter."""
    meta = reply.meta_info.model_copy(update={"weight_version": str(lease.version)})
    return reply.model_copy(update={"meta_info": meta})


def _routing_header(key: str | None) -> bytes:
    """The `X-SMG-Routing-Key` line for a session (none without one). A key is an id the
    gateway made; CR/LF are dropped anyway so it can never end the header block."""
    if key is None:
        return b""
    clean = key.replace("\r", "").replace("\n", "")
    return f"{ROUTING_KEY_HEADER}: {clean}\r\n".encode("utf-8", "replace")
