"""SGLangClient: the `Backend` of SGLang-protocol servers (SGLang itself and the local
engine), one thin named method per endpoint. Every endpoint and field used, the wire
models and the SGLang versions they were checked against: `areal_service/sglang_protocol.py`.
The generate call's body, reply and stream parsers are module functions, which
`RouterClient` (`gateway/backends/router.py`) sends through SGLang's router too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from areal_service import sglang_protocol as routes
from areal_service.sglang_protocol import (
    AbortRequest,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    Endpoint,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterRequest,
    LoRAUpdateResponse,
    ModelInfo,
    PauseMode,
    PauseRequest,
    SamplingParams,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsResponse,
    WeightUpdateSessionRequest,
)
from gateway.backends.base import Backend
from gateway.backends.errors import BackendError
from gateway.backends.records import TokenRequest
from gateway.backends.transport import ChunkParser, EngineHttp
from gateway.stream_parse import SuffixParser, WholeChunks


def sglang_body(payload: TokenRequest, *, stream: bool) -> tuple[str, bytes]:
    """Path and body of SGLang's `/generate` for `payload`: only the fields the gateway
    chose go on the wire (`exclude_unset`), so SGLang's own defaults (and its
    `--preferred-sampling-params`) apply to the rest. Built without validation: the
    record's values were validated when it was made."""
    fields: dict[str, Any] = {
        "input_ids": payload.input_ids,
        "sampling_params": payload.sampling_params,
        "rid": payload.rid,
        "return_logprob": payload.return_logprob,
        "stream": stream,
    }
    if payload.top_logprobs_num:
        fields["top_logprobs_num"] = payload.top_logprobs_num
    if payload.lora_set:  # None: the base model, sent as null
        fields["lora_path"] = payload.lora_path
    body = GenerateRequest.model_construct(**fields, **payload.engine_fields)
    return routes.GENERATE.path, body.model_dump_json(exclude_unset=True).encode()


def sglang_reply(raw: bytes, payload: TokenRequest) -> GenerateResponse:
    """A non-streamed `/generate` reply, parsed (ValidationError when malformed)."""
    return GenerateResponse.model_validate_json(raw)


def sglang_parser(payload: TokenRequest, new_only: bool) -> ChunkParser:
    """Parser of one `/generate` stream: `SuffixParser` cuts cumulative chunks to their
    new tokens (`new_only`), `WholeChunks` parses them whole."""
    return SuffixParser() if new_only else WholeChunks()


async def sglang_model_info(http: EngineHttp) -> ModelInfo:
    """`/model_info` (or `/get_model_info`) of an SGLang server or router."""
    raw = await http.get_with_fallback(routes.MODEL_INFO)
    try:
        return ModelInfo.model_validate_json(raw)
    except ValidationError as e:
        raise http.malformed(routes.MODEL_INFO.path, e) from e


async def sglang_server_info(http: EngineHttp) -> dict[str, Any]:
    """`/server_info` (or `/get_server_info`) of an SGLang server or router."""
    result: dict[str, Any] = json.loads(await http.get_with_fallback(routes.SERVER_INFO))
    return result


class SGLangClient(Backend):
    """Client of one SGLang-protocol server (an SGLang server or the local engine)."""

    # -- the wire format (module functions: `RouterClient` speaks it too) ---------------
    _generate_body = staticmethod(sglang_body)
    _generate_reply = staticmethod(sglang_reply)
    _stream_parser = staticmethod(sglang_parser)

    # -- control -----------------------------------------------------------------------
    async def abort_request(self, rid: str = "", *, abort_all: bool = False) -> None:
        """Abort by rid PREFIX (SGLang's rule), or everything with `abort_all`."""
        await self.http.control(routes.ABORT_REQUEST, AbortRequest(rid=rid, abort_all=abort_all))

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Pause; `abort` ends in-flight requests with finish_reason abort."""
        await self.http.control(routes.PAUSE_GENERATION, PauseRequest(mode=mode))

    async def continue_generation(self) -> None:
        await self.http.control(routes.CONTINUE_GENERATION, ContinueGenerationRequest())

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, *, lora_name: str | None = None
    ) -> str:
        """Load HF weights from `model_path` (same architecture); returns the message.
        Raises BackendError on `success: false`. Uses the long timeout (disk loads).
        `lora_name`: a named policy's adapter (the local engine's extension)."""
        body = UpdateWeightsFromDiskRequest(
            model_path=model_path,
            flush_cache=lora_name is None,  # an adapter's load keeps the cache
            **({} if weight_version is None else {"weight_version": weight_version}),
            **({} if lora_name is None else {"lora_name": lora_name}),
        )
        return await self._weights_call(routes.UPDATE_WEIGHTS_FROM_DISK, body)

    async def _weights_call(self, endpoint: Endpoint, body: BaseModel) -> str:
        """A weight-update call answered `{success, message}`; BackendError on
        `success: false`. Uses the long timeout (disk loads, waits on the trainer)."""
        raw = await self.http.call(endpoint, body)
        try:
            result = UpdateWeightsResponse.model_validate_json(raw)
        except ValidationError as e:
            raise self.http.malformed(endpoint.path, e) from e
        if not result.success:
            raise self.http.failed(result.message)
        return result.message

    async def init_weights_update_group(self, body: InitWeightsUpdateGroupRequest) -> str:
        """Join the trainer's weight-update group; returns once every rank joined."""
        return await self._weights_call(routes.INIT_WEIGHTS_UPDATE_GROUP, body)

    async def update_weights_from_distributed(
        self, body: UpdateWeightsFromDistributedRequest
    ) -> str:
        """Receive one bucket broadcast by the trainer (which must be sending meanwhile)."""
        return await self._weights_call(routes.UPDATE_WEIGHTS_FROM_DISTRIBUTED, body)

    async def destroy_weights_update_group(self, group_name: str) -> str:
        return await self._weights_call(
            routes.DESTROY_WEIGHTS_UPDATE_GROUP,
            DestroyWeightsUpdateGroupRequest(group_name=group_name),
        )

    async def begin_weight_update(self) -> None:
        """`/begin_weight_update`: SGLang 0.5.23 refuses `update_weights_from_distributed`
        outside such a session. An older SGLang (404) has none: nothing to open. A session
        left open (a gateway that died mid-swap) is closed and opened again."""
        try:
            await self._weights_call(routes.BEGIN_WEIGHT_UPDATE, WeightUpdateSessionRequest())
        except BackendError as e:
            if e.status == 404:
                return
            if "already open" not in e.message:
                raise
            await self.end_weight_update()
            await self._weights_call(routes.BEGIN_WEIGHT_UPDATE, WeightUpdateSessionRequest())

    async def end_weight_update(self) -> None:
        """`/end_weight_update` (404 on an older SGLang: no session to close)."""
        try:
            await self._weights_call(routes.END_WEIGHT_UPDATE, WeightUpdateSessionRequest())
        except BackendError as e:
            if e.status != 404:
                raise

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """SGLang's `/load_lora_adapter`: serve the adapter directory `path` as `name`."""
        await self._lora_call(
            routes.LOAD_LORA_ADAPTER, LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
        )

    async def unload_lora_adapter(self, name: str) -> None:
        """SGLang's `/unload_lora_adapter` (it waits for the adapter's running requests)."""
        await self._lora_call(routes.UNLOAD_LORA_ADAPTER, UnloadLoRAAdapterRequest(lora_name=name))

    async def _lora_call(self, endpoint: Endpoint, body: BaseModel) -> None:
        try:
            raw = await self.http.call(endpoint, body)
        except BackendError as e:  # 400 with `{success: false, error_message}`
            try:
                reply = LoRAUpdateResponse.model_validate_json(e.message)
            except ValidationError:
                raise e from None
            raise BackendError(e.status, reply.error_message or e.message, url=self.base_url) from e
        try:
            result = LoRAUpdateResponse.model_validate_json(raw)
        except ValidationError as e:
            raise self.http.malformed(endpoint.path, e) from e
        if not result.success:
            raise self.http.failed(result.error_message or "LoRA update failed")

    async def flush_cache(self) -> None:
        """Flush the prefix cache; BackendError(400) while requests are running."""
        await self.http.control(routes.FLUSH_CACHE)

    # -- information -------------------------------------------------------------------
    async def score_tokens(
        self, ids: Sequence[int], start: int, *, lora_name: str | None = None
    ) -> list[float]:
        """`/generate` with `return_logprob` and `logprob_start_len`: the prompt logprobs
        (SGLang's `input_token_logprobs`; the local engine answers without generating),
        the last `len(ids) - start`. Asked from `start - 1`: SGLang (0.5.23) gives the
        token AT `logprob_start_len` no logprob (None: its logits come from the position
        before, outside the range). One token is asked for because SGLang generates at
        least one."""
        body = GenerateRequest(
            input_ids=list(ids),
            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
            return_logprob=True,
            logprob_start_len=start - 1,
            **({} if lora_name is None else {"lora_path": lora_name}),
        )
        raw = await self.http.call(routes.GENERATE, body)
        try:
            reply = GenerateResponse.model_validate_json(raw)
        except ValidationError as e:
            raise self.http.malformed(routes.GENERATE.path, e) from e
        scored = reply.meta_info.input_token_logprobs or []
        want = len(ids) - start
        return [float("nan") if t[0] is None else float(t[0]) for t in scored[-want:]]

    async def health(self, timeout_s: float = 10.0) -> bool:
        """True on 200 from `/health`; False on 503, errors and timeouts."""
        return await self.http.healthy(routes.HEALTH, timeout_s)

    async def model_info(self) -> ModelInfo:
        """`/model_info`, falling back to the older `/get_model_info` on 404."""
        return await sglang_model_info(self.http)

    async def server_info(self) -> dict[str, Any]:
        """Every ServerArgs field plus scheduler state (shape varies by version; shown,
        never relied on, so left untyped)."""
        return await sglang_server_info(self.http)
