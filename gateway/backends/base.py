"""`Backend`: the one declared interface of an engine client, generation and control,
and what every engine shares above its wire format (an ABC, as vLLM's `EngineClient`).

Siblings implement it, none subclasses another: `SGLangClient` (SGLang servers and the
local engine, which speaks SGLang's protocol), `VLLMClient`, and `RouterClient` (SGLang's
router). Each translates at its own edge: the three wire hooks (`_generate_body`,
`_generate_reply`, `_stream_parser`) and the control calls are the engine's; HTTP goes
through the `EngineHttp` it holds (composition). Above this line (routing, capture,
continuity, interruptible generation, swaps) the gateway cannot tell engines apart and
receives only `gateway.backends.records` (`Generation`, `GenerationDelta`,
`SwapTimings`).

What this class owns for every engine: versioned adapter leases (`gateway/adapters.py`:
a policy's request runs under the name serving it now and its tokens carry that name's
version), interruptible generation (`gateway/backends/interruptible.py`) and the swap
sequences: pause → load → continue (continue always sent), or a policy adapter's load
beside the live one with no pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Sequence
from typing import Any, Protocol, Unpack

from areal_service.sglang_protocol import (
    InitWeightsUpdateGroupRequest,
    ModelInfo,
    PauseMode,
    UpdateWeightsFromDistributedRequest,
)
from gateway.adapters import AdapterNames, Lease, served_name
from gateway.backends import interruptible
from gateway.backends.errors import BackendError
from gateway.backends.records import (
    EngineReply,
    Generation,
    GenerationDelta,
    SwapTimings,
    TokenRequest,
)
from gateway.backends.transport import ChunkParser, ClientOptions, EngineHttp, HttpOptions

log = logging.getLogger(__name__)
_UNLOAD_POLL_S = 0.25
"""How often a retired adapter name's unload task checks whether it drained."""


class SwapCheck(Protocol):
    """The canary check of a swap (`gateway/swap_verify.py`), run by `swap_weights` at
    the moment the engine can still refuse the version unseen: while paused (an engine
    that scores paused), or before a versioned adapter's switch. It records the
    engine's verdict itself; `refused` tells it the engine already went back."""

    fallback: tuple[str, int] | None
    """The last verified (path, version) a refused full swap reloads while paused."""

    async def __call__(self, backend: Backend, adapter: str | None) -> bool:
        """Score the canary on `backend` under `adapter`; True when it passed."""
        ...

    def refused(self, backend: Backend) -> None:
        """`backend` refused the version and already serves the verified one again."""
        ...


class Backend(ABC):
    """Client of one engine server (or router) at `base_url`. Call `aclose()` (or use
    `async with`) when done. `adapters`: versioned adapter names on a server that loads
    LoRA adapters by name (vLLM, SGLang with LoRA); None: the local engine, which
    versions its adapters itself, or no LoRA."""

    def __init__(
        self,
        base_url: str,
        *,
        adapters: AdapterNames | None = None,
        **options: Unpack[ClientOptions],
    ) -> None:
        self.http = EngineHttp(base_url, self.abort_request, HttpOptions(**options))
        self.base_url = self.http.base_url
        self.adapters = adapters
        self.scores_while_paused = False
        """Whether `score_tokens` answers while generation is paused (the local engine:
        set by the factory); then a full swap is checked before continue."""
        self._unloads: set[asyncio.Task[None]] = set()

    async def aclose(self) -> None:
        """Drop pending adapter unloads (they wait for a drain: not worth waiting for),
        wait for pending aborts, close the HTTP connections."""
        for task in self._unloads:
            task.cancel()
        if self._unloads:
            await asyncio.gather(*self._unloads, return_exceptions=True)
        await self.http.aclose()

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the engine's wire format ------------------------------------------------------
    @abstractmethod
    def _generate_body(self, payload: TokenRequest, *, stream: bool) -> tuple[str, bytes]:
        """Path and body of the token-in generate call for `payload`."""

    @abstractmethod
    def _generate_reply(self, raw: bytes, payload: TokenRequest) -> EngineReply:
        """A non-streamed reply, parsed (ValidationError when malformed)."""

    @abstractmethod
    def _stream_parser(self, payload: TokenRequest, new_only: bool) -> ChunkParser:
        """Parser of one stream's SSE payloads (see `generate_stream`)."""

    # -- generation --------------------------------------------------------------------
    def _adapter_policy(self, payload: TokenRequest) -> str | None:
        """The policy whose versioned adapter `payload` runs under (None: not leased)."""
        names = self.adapters
        if names is None:
            return None
        return payload.lora_path or names.default_policy

    async def generate(
        self, payload: TokenRequest, *, routing_key: str | None = None
    ) -> EngineReply:
        """One non-streamed generation. Cancelling the caller aborts the request.
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

    async def _generate(self, payload: TokenRequest, routing_key: str | None) -> EngineReply:
        path, body = self._generate_body(payload, stream=False)
        raw = await self.http.generate(path, body, payload.rid, routing_key)
        try:
            return self._generate_reply(raw, payload)
        except ValueError as e:  # pydantic's ValidationError too
            raise self.http.malformed(path, e) from e

    def generate_stream(
        self,
        payload: TokenRequest,
        *,
        coalesce: bool = False,
        new_only: bool = False,
        routing_key: str | None = None,
    ) -> AsyncGenerator[EngineReply, None]:
        """One streamed generation: a chunk per SSE `data:` payload, through `[DONE]`
        (`EngineHttp.stream`); a policy's request on versioned adapters is leased as
        in `generate`.

        `coalesce`: when one network read holds several CUMULATIVE chunks (the caller
        fell behind), yield only the newest: it contains the others. Under load this
        turns N JSON parses and N downstream writes into one; incremental chunks are
        always yielded one by one.

        `new_only`: a cumulative chunk is cut to what is new before it is parsed
        (`SuffixParser`): its `output_ids` and logprobs hold only the tokens after the
        previous chunk's (so `cumulative` is False from the second chunk on), and the
        parse costs O(new tokens), not O(tokens so far)."""
        if self.adapters is not None and (policy := self._adapter_policy(payload)) is not None:
            return self._leased_stream(payload, policy, coalesce, new_only, routing_key)
        return self._stream(payload, coalesce, new_only, routing_key)

    def _stream(
        self, payload: TokenRequest, coalesce: bool, new_only: bool, routing_key: str | None
    ) -> AsyncGenerator[EngineReply, None]:
        path, body = self._generate_body(payload, stream=True)
        parser = self._stream_parser(payload, new_only)
        return self.http.stream(path, body, payload.rid, parser, coalesce, routing_key)

    async def _leased_stream(
        self,
        payload: TokenRequest,
        policy: str,
        coalesce: bool,
        new_only: bool,
        routing_key: str | None,
    ) -> AsyncGenerator[EngineReply, None]:
        assert self.adapters is not None
        lease = self.adapters.acquire(policy)
        try:
            leased = _on_adapter(payload, lease)
            async with contextlib.aclosing(
                self._stream(leased, coalesce, new_only, routing_key)
            ) as chunks:
                async for chunk in chunks:
                    yield _tagged(chunk, lease)
        finally:
            self.adapters.release(lease)

    async def generate_interruptible(
        self, request: TokenRequest, *, routing_key: str | None = None
    ) -> Generation:
        """`generate`, resubmitting on pause-aborts until a stop/length finish
        (`gateway.backends.interruptible.generate_interruptible`)."""
        return await interruptible.generate_interruptible(
            lambda r: self.generate(r, routing_key=routing_key), request, self.http
        )

    def generate_interruptible_stream(
        self, request: TokenRequest, *, routing_key: str | None = None
    ) -> AsyncGenerator[GenerationDelta, None]:
        """Streaming `generate_interruptible`: only NEW tokens per delta, across
        resubmissions (`gateway.backends.interruptible.generate_interruptible_stream`)."""
        return interruptible.generate_interruptible_stream(
            lambda r: self.generate_stream(
                r, coalesce=True, new_only=True, routing_key=routing_key
            ),
            request,
            self.http,
        )

    @abstractmethod
    async def abort_request(self, rid: str = "", *, abort_all: bool = False) -> None:
        """Abort by rid PREFIX (SGLang's rule), or everything with `abort_all`."""

    # -- information -------------------------------------------------------------------
    @abstractmethod
    async def health(self, timeout_s: float = 10.0) -> bool:
        """True while the server can take requests; False on errors and timeouts."""

    @abstractmethod
    async def model_info(self) -> ModelInfo:
        """The served checkpoint and its weight version (and named adapters' versions)."""

    @abstractmethod
    async def server_info(self) -> dict[str, Any]:
        """The server's settings, for display and the weight-update group's layout."""

    @abstractmethod
    async def flush_cache(self) -> None:
        """Flush the prefix cache."""

    # -- weights -----------------------------------------------------------------------
    @abstractmethod
    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Pause; `abort` ends in-flight requests with finish_reason abort."""

    @abstractmethod
    async def continue_generation(self) -> None:
        """Resume after `pause_generation`."""

    @abstractmethod
    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, *, lora_name: str | None = None
    ) -> str:
        """Load weights from `model_path` and label them `weight_version`; returns the
        server's message. `lora_name`: a named policy's adapter (local engine)."""

    @abstractmethod
    async def init_weights_update_group(self, body: InitWeightsUpdateGroupRequest) -> str:
        """Join the trainer's weight-update group; returns once every rank joined."""

    @abstractmethod
    async def update_weights_from_distributed(
        self, body: UpdateWeightsFromDistributedRequest
    ) -> str:
        """Receive one bucket broadcast by the trainer (which must be sending meanwhile)."""

    @abstractmethod
    async def destroy_weights_update_group(self, group_name: str) -> str:
        """Leave the weight-update group `group_name`."""

    @abstractmethod
    async def begin_weight_update(self) -> None:
        """Open the server's weight-update session, inside which SGLang (0.5.23) accepts
        `update_weights_from_distributed`; a server without sessions takes it as a no-op."""

    @abstractmethod
    async def end_weight_update(self) -> None:
        """Close the session `begin_weight_update` opened."""

    @abstractmethod
    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the adapter directory `path` under `name` (400 "already" for a name
        the server holds)."""

    @abstractmethod
    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (404 for a name the server does not hold)."""

    async def score_tokens(
        self, ids: Sequence[int], start: int, *, lora_name: str | None = None
    ) -> list[float]:
        """Teacher-forced logprobs of `ids[start:]`, each given the tokens before it
        (temperature 1), under the adapter `lora_name` (the engine's name for it; None:
        the base weights): the swap canary's probe (`gateway/swap_verify.py`).
        NotImplementedError for an engine that cannot score prompt tokens."""
        raise NotImplementedError(f"{type(self).__name__} cannot score prompt tokens")

    async def score_canary(
        self, sequences: Sequence[tuple[Sequence[int], int]], *, lora_name: str | None = None
    ) -> list[list[float]]:
        """`score_tokens` of every (ids, start), in order: the swap canary's probe. Sent
        together, so an engine that batches runs them in one step; an engine that takes
        several prompts in one request overrides it (vLLM: one HTTP round trip and one
        scheduling decision instead of one per prompt)."""
        scored = await asyncio.gather(
            *(self.score_tokens(ids, start, lora_name=lora_name) for ids, start in sequences)
        )
        return list(scored)

    def canary_adapter(self, lora_name: str | None, version: int) -> str | None:
        """The adapter name to score version `version` under after
        `swap_weights(..., version, lora_name)`: the versioned served name (with the
        default policy's when `lora_name` is None), or on the local engine `lora_name`
        itself (None: the served weights, the default adapter included)."""
        policy = lora_name if self.adapters is None else lora_name or self.adapters.default_policy
        if policy is None:
            return None
        return policy if self.adapters is None else served_name(policy, version)

    async def swap_weights(
        self,
        model_path: str,
        version: int,
        lora_name: str | None = None,
        check: SwapCheck | None = None,
    ) -> SwapTimings:
        """pause(abort) → update_weights_from_disk → continue, continue ALWAYS sent (also
        when pause or the load fails; the load's error is re-raised after it).
        `lora_name`: swap only that policy's adapter instead, with no pause
        (`swap_adapter`); with versioned adapters (`self.adapters`) also the default
        policy's. `check`: the swap canary, run before continue on an engine that scores
        while paused; a refused version is replaced by `check.fallback` before continue,
        so no request sees it."""
        policy = lora_name if self.adapters is None else lora_name or self.adapters.default_policy
        if policy is not None:
            return await self.swap_adapter(policy, model_path, version, check)
        t0 = time.perf_counter()
        t1 = t2 = t0
        try:
            await self.pause_generation("abort")
            t1 = time.perf_counter()
            await self.update_weights_from_disk(model_path, str(version))
            t2 = time.perf_counter()
            if check is not None and self.scores_while_paused:
                await self._check_paused(check)
        finally:
            await self.continue_generation()
        t3 = time.perf_counter()
        return SwapTimings(pause_s=t1 - t0, update_s=t2 - t1, continue_s=t3 - t2, total_s=t3 - t0)

    async def _check_paused(self, check: SwapCheck) -> None:
        """The canary while still paused; a refusal reloads the verified version before
        the caller's continue (nothing was generated under the refused one)."""
        if await check(self, None) or check.fallback is None:
            return
        await self.update_weights_from_disk(check.fallback[0], str(check.fallback[1]))
        check.refused(self)

    async def swap_adapter(
        self, policy: str, model_path: str, version: int, check: SwapCheck | None = None
    ) -> SwapTimings:
        """Load `policy`'s version `version` (the adapter directory `model_path`) under its
        own name beside the live one, switch the policy's new requests to it, and unload
        the retired name in the background once its requests ended
        (`gateway/adapters.py`). No pause, no abort: only `update_s` is non-zero. A name
        the server already holds (a gateway restarted after loading it) counts as
        loaded: the same policy and version name the same files.

        Without versioned adapters (the local engine): one `update_weights_from_disk`
        with `lora_name` and no pause. The engine loads it between two batch steps and
        aborts only that policy's in-flight rows, which interruptible generation
        resubmits under the new version (`engine/scheduler.py`,
        `Scheduler._swap_adapter`); `lora_name` "default" (`DEFAULT_POLICY`) is the
        default policy's adapter, when other policies are declared.

        `check`: with versioned names, the canary scored under the new name before the
        switch; a refused version is never switched to (its name is unloaded) and the
        policy's requests stay on the verified one. Without them the syncer checks
        after the load (`gateway/swap_verify.py`)."""
        t0 = time.perf_counter()
        if self.adapters is None:
            await self.update_weights_from_disk(model_path, str(version), lora_name=policy)
            return SwapTimings.load_only(t0)
        served = served_name(policy, version)
        try:
            await self.load_lora_adapter(served, model_path)
        except BackendError as e:
            if e.status != 400 or "already" not in e.message:
                raise
        if check is not None and not await check(self, served):
            check.refused(self)
            self.http.spawn(self._unload_refused(served))
            return SwapTimings.load_only(t0)
        retired = self.adapters.switch(policy, version)
        if retired is not None:
            self._unload_when_drained(retired)
        return SwapTimings.load_only(t0)

    async def _unload_refused(self, served: str) -> None:
        """Unload an adapter name the canary refused (no request ever ran under it)."""
        try:
            await self.unload_lora_adapter(served)
        except BackendError as e:
            log.warning("unload of refused adapter %s failed: %s", served, e)

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
        if self.adapters.current(policy).served == served_name(policy, version):
            return
        retired = self.adapters.switch(policy, version)
        if retired is not None:
            self.adapters.unloaded(retired)  # the leader's to unload

    def retire_policy(self, policy: str) -> bool:
        """`policy` was deleted: with versioned adapter names (vLLM, SGLang) its live
        adapter is unloaded once its requests ended (`_unload_when_drained`) and True;
        False on an engine that loads adapters in place under the policy's own name (the
        local engine, which has no unload: the adapter stays until it restarts)."""
        if self.adapters is None:
            return False
        served = self.adapters.retire(policy)
        if served is not None:
            self._unload_when_drained(served)
        return True

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


def _on_adapter(payload: TokenRequest, lease: Lease) -> TokenRequest:
    """`payload` sent under the lease's served name (`lora_path`; None, set explicitly:
    the base model)."""
    return payload.on_adapter(lease.served)


def _tagged(reply: EngineReply, lease: Lease) -> EngineReply:
    """`reply` with the lease's version as its weight version: the server's own label is
    one per server, not per adapter."""
    return reply.with_version(str(lease.version))
