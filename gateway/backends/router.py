"""RouterClient: the `Backend` of SGLang's router (`sglang-router`, `gateway.router.url`).
Generation goes to the router in SGLang's `/generate` format (the session as
`X-SMG-Routing-Key`), which picks a worker; `/abort_request`, which the router does not
route, goes to every worker `workers()` names (a rid lives on one of them, the others
ignore it). Weight control never goes through here: the pool sends it to each worker's
own client, so those calls raise (501). Endpoints and the versions checked:
`areal_service/sglang_protocol.py`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Unpack

from areal_service.sglang_protocol import (
    ROUTER_READINESS,
    ROUTER_WORKERS,
    InitWeightsUpdateGroupRequest,
    ModelInfo,
    PauseMode,
    UpdateWeightsFromDistributedRequest,
    router_worker_urls,
)
from gateway.backends.base import Backend
from gateway.backends.sglang import (
    sglang_body,
    sglang_model_info,
    sglang_parser,
    sglang_reply,
    sglang_server_info,
)
from gateway.backends.transport import ClientOptions


class RouterClient(Backend):
    """Client of SGLang's router; `workers`: the clients of its current workers."""

    def __init__(
        self,
        base_url: str,
        workers: Callable[[], Sequence[Backend]],
        **options: Unpack[ClientOptions],
    ) -> None:
        super().__init__(base_url, **options)
        self._workers = workers

    # -- the wire format: SGLang's -----------------------------------------------------
    _generate_body = staticmethod(sglang_body)
    _generate_reply = staticmethod(sglang_reply)
    _stream_parser = staticmethod(sglang_parser)

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

    # -- information -------------------------------------------------------------------
    async def list_workers(self) -> list[str]:
        """Base URLs of the router's workers (`GET /workers`, else the older
        `/list_workers`)."""
        raw = await self.http.get_with_fallback(ROUTER_WORKERS)
        try:
            listing = json.loads(raw)
        except ValueError as e:
            raise self.http.malformed(ROUTER_WORKERS.path, e) from e
        if not isinstance(listing, dict):
            raise self.http.failed(f"malformed {ROUTER_WORKERS.path} reply", 502)
        return router_worker_urls(listing)

    async def health(self, timeout_s: float = 10.0) -> bool:
        """True while the router is up and has a healthy worker (`/readiness`; `/health`
        on routers without it, which only says the router runs)."""
        return await self.http.healthy(ROUTER_READINESS, timeout_s)

    async def model_info(self) -> ModelInfo:
        return await sglang_model_info(self.http)

    async def server_info(self) -> dict[str, Any]:
        return await sglang_server_info(self.http)

    # -- weight control: each worker's own client ---------------------------------------
    def _workers_only(self, call: str) -> NoReturn:
        raise self.http.failed(f"{call} goes to each worker's own client, not the router", 501)

    async def flush_cache(self) -> None:
        self._workers_only("flush_cache")

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        self._workers_only("pause_generation")

    async def continue_generation(self) -> None:
        self._workers_only("continue_generation")

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, *, lora_name: str | None = None
    ) -> str:
        self._workers_only("update_weights_from_disk")

    async def init_weights_update_group(self, body: InitWeightsUpdateGroupRequest) -> str:
        self._workers_only("init_weights_update_group")

    async def update_weights_from_distributed(
        self, body: UpdateWeightsFromDistributedRequest
    ) -> str:
        self._workers_only("update_weights_from_distributed")

    async def destroy_weights_update_group(self, group_name: str) -> str:
        self._workers_only("destroy_weights_update_group")

    async def begin_weight_update(self) -> None:
        self._workers_only("begin_weight_update")

    async def end_weight_update(self) -> None:
        self._workers_only("end_weight_update")

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self._workers_only("load_lora_adapter")

    async def unload_lora_adapter(self, name: str) -> None:
        self._workers_only("unload_lora_adapter")
