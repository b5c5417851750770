"""HTTP face of the local engine: SGLang's native API subset on FastAPI + uvicorn.

Owns request validation, the asyncio side of each generation (waiting, SSE streaming,
detokenizing) and the control endpoints; all model work is the scheduler thread's
(`scheduler.py`), reached through its thread-safe methods. Bodies and paths are the
models of `areal_service/sglang_protocol.py`, the ones the gateway's client speaks;
where this engine differs from SGLang it says so in a docstring.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import uvicorn
from fastapi import APIRouter, Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from transformers import AutoConfig, AutoTokenizer

from areal_service import __version__
from areal_service.config import EngineConfig, ServiceConfig
from areal_service.cpu_share import host_cores
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
    DestroyWeightsUpdateGroupRequest,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    MetaInfo,
    ModelCard,
    ModelInfo,
    ModelList,
    PauseRequest,
    SamplingParams,
    ServerInfo,
    StatusMessage,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsResponse,
)
from engine.runner import eos_token_ids, resolve_device, resolve_dtype
from engine.scheduler import Request as EngineRequest
from engine.scheduler import RequestView, Scheduler
from engine.weight_groups import WeightGroups

logger = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT_S = 20.0
"""SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default."""
HEALTH_PROGRESS_POLL_S = 0.2
"""How often a health check waiting for its token looks for other requests' tokens."""
DISCONNECT_POLL_S = 4.0
"""How often a non-streaming request checks whether its client went away."""


class InternalState(BaseModel):
    """This engine's `server_info.internal_states[0]`; `forward_calls` shows batching
    (one forward serves many rows)."""

    model_config = ConfigDict(frozen=True)

    running: int
    waiting: int
    paused: bool
    pause_mode: str | None
    update_pending: bool
    forward_calls: int
    prefill_forward_calls: int
    decode_steps: int
    generated_tokens: int
    last_gen_throughput: float


class EngineError(Exception):
    """Answered as `{"error": {"message": ...}}` with `status` (SGLang's native envelope)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


class Engine:
    """Per-app state: tokenizer, limits, the scheduler and the rids in flight."""

    def __init__(
        self, config: EngineConfig, model_dir: Path | str, cpu_share_file: Path | None = None
    ) -> None:
        self.config = config
        self.model_dir = str(Path(model_dir))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        text_config = self.hf_config.get_text_config()
        self.vocab_size = int(text_config.vocab_size)
        self.context_length = int(config.context_length or text_config.max_position_embeddings)
        self.eos_token_ids = eos_token_ids(Path(self.model_dir), self.hf_config)
        device = resolve_device(config.device)
        self.device = str(device)
        self.dtype = str(resolve_dtype(config.dtype, device)).removeprefix("torch.")
        self.scheduler = Scheduler(
            self.model_dir,
            device=self.device,
            dtype=self.dtype,
            max_running=config.max_running_requests,
            weight_version=config.weight_version,
            cpu_share_file=cpu_share_file,
        )
        self.weight_groups = WeightGroups()
        self.weight_session = False
        """Between `/begin_weight_update` and `/end_weight_update` (SGLang's rule: a
        distributed update outside one is refused)."""
        self.inflight: dict[str, Job] = {}
        self.started_at = int(time.time())

    @property
    def served_model_name(self) -> str:
        """`served_model_name`, else the current model path (which a disk update changes, as
        in SGLang)."""
        return self.config.served_model_name or self.scheduler.model_path

    def new_job(self, body: GenerateRequest) -> Job:
        """Validate a /generate body (400 on bad input) and register its rid."""
        if (
            isinstance(body.rid, list)
            or (body.input_ids and isinstance(body.input_ids[0], list))
            or isinstance(body.text, list)
        ):
            raise EngineError(
                "batched /generate input is not supported by the local engine; "
                "send one request per prompt"
            )
        if (body.text is None) == (body.input_ids is None):
            raise EngineError("Either text or input_ids should be provided.")
        if body.sampling_params.n != 1:
            raise EngineError(
                "n > 1 is not supported by the local engine; send n separate requests."
            )
        ids = body.prompt_ids if body.input_ids is not None else self.tokenizer.encode(body.text)
        self.check_prompt(ids, body.sampling_params)
        rid = str(body.rid or uuid.uuid4().hex)
        if rid in self.inflight:
            raise EngineError(f"Duplicate request ID detected: {rid}")
        job = Job(self, body, ids, rid)
        self.inflight[rid] = job
        return job

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise EngineError("The input_ids is empty.")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise EngineError(
                f"input_ids contain ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        biased = [t for t in params.logit_bias or {} if not int(t) < self.vocab_size]
        if biased:
            raise EngineError(
                f"logit_bias names ids outside the vocabulary [0, {self.vocab_size}): {biased[:5]}"
            )
        limit = self.context_length
        new = params.max_new_tokens if params.max_new_tokens is not None else 0
        if len(ids) >= limit or len(ids) + new > limit:
            raise EngineError(
                f"Requested token count exceeds the model's maximum context length of {limit} "
                f"tokens. You requested a total of {len(ids) + new} tokens: {len(ids)} tokens from "
                f"the input messages and {new} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )

    def health_job(self) -> Job:
        body = GenerateRequest(
            input_ids=[0], sampling_params=SamplingParams(max_new_tokens=1, temperature=0)
        )
        return Job(self, body, [0], f"HEALTH_CHECK_{uuid.uuid4().hex}")


class Job:
    """The asyncio side of one generation: wakes on the scheduler's notify, renders views."""

    def __init__(
        self, engine: Engine, body: GenerateRequest, prompt_ids: list[int], rid: str
    ) -> None:
        self.engine, self.body, self.rid = engine, body, rid
        params = body.sampling_params
        max_new = params.max_new_tokens
        if max_new is None:
            max_new = engine.context_length - len(prompt_ids)
        stops = (
            frozenset()
            if params.ignore_eos
            else engine.eos_token_ids | set(params.stop_token_ids or ())
        )
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()
        self.request = EngineRequest(
            rid=rid,
            prompt_ids=prompt_ids,
            params=params,
            max_new_tokens=max_new,
            stop_token_ids=frozenset(stops),
            notify=self._notify_threadsafe,
            top_logprobs_num=body.top_logprobs_num if body.return_logprob else 0,
            stream=body.stream,
            lora=body.lora_path,
        )

    def _notify_threadsafe(self) -> None:
        # Called on the scheduler thread; the loop is closed only after the scheduler stops.
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self.event.set()
        if self.request.finish is not None:
            self.release()

    def release(self) -> None:
        """Free the rid (idempotent); abort the request if it is still going."""
        if self.engine.inflight.get(self.rid) is self:
            del self.engine.inflight[self.rid]
        if self.request.finish is None:
            self.engine.scheduler.abort(self.rid, exact=True)

    async def submit(self) -> None:
        await asyncio.wrap_future(self.engine.scheduler.submit(self.request))

    async def views(self) -> AsyncIterator[RequestView]:
        """Yields each new state (coalescing steps a slow reader missed) until finished."""
        seen = -1
        while True:
            await self.event.wait()
            self.event.clear()
            view = self.request.snapshot()
            if view.finish is None and len(view.output_ids) == seen:
                continue
            seen = len(view.output_ids)
            yield view
            if view.finish is not None:
                return

    async def final(self, http: Request | None = None) -> RequestView:
        """Wait for the end; abort (exact rid) if the HTTP client went away, as SGLang does."""
        while True:
            try:
                await asyncio.wait_for(self.event.wait(), DISCONNECT_POLL_S)
            except TimeoutError:
                if http is not None and await http.is_disconnected():
                    self.engine.scheduler.abort(self.rid, exact=True)
                continue
            self.event.clear()
            view = self.request.snapshot()
            if view.finish is not None:
                return view

    def render(self, view: RequestView) -> GenerateResponse:
        params, req = self.body.sampling_params, self.request
        ids = list(view.output_ids)
        finish = view.finish
        text_ids = ids
        stopped = finish is not None and finish.type == "stop" and not params.no_stop_trim
        if stopped and isinstance(finish.matched, int):
            text_ids = ids[:-1]
        tok = self.engine.tokenizer
        text = tok.decode(text_ids, skip_special_tokens=params.skip_special_tokens)
        if stopped and isinstance(finish.matched, str):
            pos = text.find(finish.matched)
            text = text[:pos] if pos >= 0 else text
        if finish is None:
            # Hold back a trailing incomplete UTF-8 character, as SGLang's detokenizer does,
            # so cumulative chunk texts only ever grow.
            text = text.rstrip("\ufffd")
        meta: dict[str, Any] = {}
        if self.body.return_logprob:
            with_text = self.body.return_text_in_logprobs
            meta["output_token_logprobs"] = [
                (lp, t, tok.decode([t]) if with_text else None)
                for lp, t in zip(view.logprobs, ids, strict=True)
            ]
            if self.body.top_logprobs_num > 0:
                meta["output_top_logprobs"] = [
                    [(lp, t, tok.decode([t]) if with_text else None) for lp, t in row]
                    for row in view.top_logprobs
                ]
        if view.finished_at is not None:
            meta["e2e_latency"] = view.finished_at - req.created_at
        return GenerateResponse(
            text=text,
            output_ids=ids,
            meta_info=MetaInfo(
                id=self.rid,
                finish_reason=finish,
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=len(ids),
                cached_tokens=0,
                weight_version=view.weight_version,
                **meta,
            ),
        )

    async def sse(self) -> AsyncIterator[str]:
        """Cumulative chunks (SGLang's default), `finish_reason` null until the last, then
        `[DONE]`. Closing the stream early (client gone) aborts the request."""
        try:
            async for view in self.views():
                yield f"data: {self.render(view).model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.release()


def _engine(request: Request) -> Engine:
    return request.app.state.engine


EngineDep = Annotated[Engine, Depends(_engine)]
router = APIRouter()


def _json(model: Any, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _weights_reply(success: bool, message: str) -> Response:
    """SGLang's reply to a weight call: 200 when it succeeded, else 400."""
    return _json(UpdateWeightsResponse(success=success, message=message), 200 if success else 400)


@router.api_route(GENERATE.path, methods=["POST", "PUT"])
async def generate(body: GenerateRequest, request: Request, engine: EngineDep) -> Response:
    if body.return_logprob and body.logprob_start_len >= 0 and not body.stream:
        return _json(await _score(body, engine))
    job = engine.new_job(body)
    try:
        await job.submit()
    except RuntimeError as exc:  # the scheduler thread is gone (crashed or stopping)
        job.release()
        raise EngineError(str(exc), 503) from exc
    if body.stream:
        return StreamingResponse(job.sse(), media_type="text/event-stream")
    try:
        view = await job.final(request)
    finally:
        job.release()
    return _json(job.render(view))


async def _score(body: GenerateRequest, engine: Engine) -> GenerateResponse:
    """A prompt-logprob request (`return_logprob` with `logprob_start_len` >= 1): the
    local engine answers it with the prompt's logprobs from that position and generates
    nothing (`output_ids` empty, finish `length`), at once, paused or not. The gateway
    sends it only to score the swap canary (`gateway/swap_verify.py`)."""
    ids = body.prompt_ids
    start = body.logprob_start_len
    if not 1 <= start < len(ids):
        raise EngineError(f"logprob_start_len must be in [1, {len(ids)}), got {start}")
    engine.check_prompt(ids, body.sampling_params.model_copy(update={"max_new_tokens": 0}))
    future = engine.scheduler.score(ids, start, body.lora_path)
    try:
        logprobs, version = await asyncio.wrap_future(future)
    except RuntimeError as exc:  # the scheduler thread is gone
        raise EngineError(str(exc), 503) from exc
    return GenerateResponse(
        output_ids=[],
        meta_info=MetaInfo(
            id=str(body.rid or uuid.uuid4().hex),
            finish_reason=FinishReason(type="length", length=0),
            prompt_tokens=len(ids),
            weight_version=version,
            input_token_logprobs=[
                (lp, t, None) for lp, t in zip(logprobs, ids[start:], strict=True)
            ],
        ),
    )


@router.post(PAUSE_GENERATION.path)
async def pause_generation(
    engine: EngineDep, body: Annotated[PauseRequest | None, Body()] = None
) -> Response:
    await asyncio.wrap_future(engine.scheduler.pause((body or PauseRequest()).mode))
    return _json(StatusMessage(message="Generation paused successfully."))


@router.post(CONTINUE_GENERATION.path)
async def continue_generation(engine: EngineDep) -> Response:
    await asyncio.wrap_future(engine.scheduler.resume())
    return _json(StatusMessage(message="Generation continued successfully."))


@router.post(UPDATE_WEIGHTS_FROM_DISK.path)
async def update_weights_from_disk(
    body: UpdateWeightsFromDiskRequest, engine: EngineDep
) -> Response:
    """Unpaused, waits for in-flight requests first (SGLang's writer lock). With
    flush_cache under an in_place pause, running rows are retracted (KV recomputed with the
    new weights after continue) where SGLang would crash its scheduler. With `lora_name`
    (one policy's adapter) it neither waits nor pauses: the adapter is loaded between two
    steps and only that policy's started rows are aborted (`Scheduler._swap_adapter`)."""
    if not Path(body.model_path).is_dir():
        return _weights_reply(
            False, f"Failed to update weights: {body.model_path} is not a directory"
        )
    result: UpdateWeightsResponse = await asyncio.wrap_future(
        engine.scheduler.update_weights(
            body.model_path,
            weight_version=body.weight_version,
            flush_cache=body.flush_cache,
            abort_all=body.abort_all_requests,
            lora_name=body.lora_name,
        )
    )
    return _json(result, 200 if result.success else 400)


@router.post(INIT_WEIGHTS_UPDATE_GROUP.path)
async def init_weights_update_group(
    body: InitWeightsUpdateGroupRequest, engine: EngineDep
) -> Response:
    """Join the trainer's group as ranks `rank_offset`.. (`engine.emulate_tp_size` of
    them, one by default); answers once every rank joined. gloo or nccl; a group of the
    same name is replaced. Refused like SGLang for dp > 1 without dp attention."""
    cfg = engine.config
    if cfg.emulate_dp_size > 1 and not cfg.emulate_dp_attention:
        return _weights_reply(
            False,
            "dp_size must be 1 or dp attention must be enabled for update weights from distributed",
        )
    try:
        await asyncio.to_thread(
            engine.weight_groups.init,
            master_address=body.master_address,
            master_port=body.master_port,
            rank=body.rank_offset,
            world_size=body.world_size,
            group_name=body.group_name,
            backend=body.backend,
            ranks=cfg.emulate_tp_size,
        )
    except (ValueError, RuntimeError) as exc:  # RuntimeError: rendezvous failed / timed out
        return _weights_reply(False, f"Failed to init weight-update group: {exc}")
    return _weights_reply(True, f"Joined weight-update group {body.group_name}.")


@router.post(UPDATE_WEIGHTS_FROM_DISTRIBUTED.path)
async def update_weights_from_distributed(
    body: UpdateWeightsFromDistributedRequest, engine: EngineDep
) -> Response:
    """Receive one bucket from the trainer's broadcast into the live model, between
    batches (unpaused: after the requests in flight now, as a disk update); the version
    is set when `weight_version` is sent (the gateway sends it with the last bucket)."""
    if not engine.weight_session:
        return _weights_reply(
            False,
            "update_weights_from_distributed must run between "
            "begin_weight_update() and end_weight_update()",
        )
    receive = functools.partial(
        engine.weight_groups.receive, body.group_name, body.names, body.dtypes, body.shapes
    )
    result: UpdateWeightsResponse = await asyncio.wrap_future(
        engine.scheduler.update_weights_from_distributed(
            receive,
            weight_version=body.weight_version,
            flush_cache=body.flush_cache,
            abort_all=body.abort_all_requests,
        )
    )
    return _json(result, 200 if result.success else 400)


@router.post(BEGIN_WEIGHT_UPDATE.path)
async def begin_weight_update(engine: EngineDep) -> Response:
    """Open the weight-update session (as SGLang 0.5.23: one at a time)."""
    return _weight_session(engine, True)


@router.post(END_WEIGHT_UPDATE.path)
async def end_weight_update(engine: EngineDep) -> Response:
    return _weight_session(engine, False)


def _weight_session(engine: Engine, open_: bool) -> Response:
    """Open (`open_`) or close the weight-update session, refused with SGLang's
    messages when it already is."""
    if engine.weight_session == open_:
        message = (
            "a weight-update session is already open; call end_weight_update() first"
            if open_
            else "no weight-update session is open; call begin_weight_update() first"
        )
        return _weights_reply(False, message)
    engine.weight_session = open_
    return _weights_reply(True, "Success")


@router.post(DESTROY_WEIGHTS_UPDATE_GROUP.path)
async def destroy_weights_update_group(
    body: DestroyWeightsUpdateGroupRequest, engine: EngineDep
) -> Response:
    if not await asyncio.to_thread(engine.weight_groups.destroy, body.group_name):
        return _weights_reply(False, f"no weight-update group {body.group_name!r}")
    return _weights_reply(True, f"Destroyed weight-update group {body.group_name}.")


@router.post(ABORT_REQUEST.path)
async def abort_request(body: AbortRequest, engine: EngineDep) -> Response:
    await asyncio.wrap_future(engine.scheduler.abort(body.rid, abort_all=body.abort_all))
    return Response(status_code=200)


@router.api_route(FLUSH_CACHE.path, methods=["GET", "POST"])
async def flush_cache(engine: EngineDep) -> Response:
    if await asyncio.wrap_future(engine.scheduler.flush_cache()):
        return PlainTextResponse("Cache flushed.")
    return PlainTextResponse(
        "Cache not flushed. (When there are running or waiting requests, the operation will "
        "not be performed.)",
        status_code=400,
    )


@router.get(HEALTH.path)
@router.get("/health_generate")
async def health(engine: EngineDep) -> Response:
    """200 when a 1-token generation completes, or as soon as the engine generated any
    token for another request since the check began (SGLang's rule: a busy engine is
    healthy, though the check's own request may queue behind a full batch for longer
    than a health timeout); 503 while loading, after a crash, or when neither happens
    within HEALTH_CHECK_TIMEOUT_S. While paused or behind a pending weight update it
    answers 200 WITHOUT generating (SGLang would time out and mark itself unhealthy
    during a swap)."""
    sched = engine.scheduler
    if sched.error is not None or not sched.alive or not sched.ready.is_set():
        return Response(status_code=503)
    if sched.paused is not None or sched.counts()[2]:
        return Response(status_code=200)
    produced = sched.generated_tokens
    job = engine.health_job()
    await job.submit()
    done = asyncio.ensure_future(job.final())
    deadline = time.monotonic() + HEALTH_CHECK_TIMEOUT_S
    try:
        while sched.generated_tokens == produced:
            left = deadline - time.monotonic()
            if left <= 0:
                return Response(status_code=503)
            await asyncio.wait({done}, timeout=min(HEALTH_PROGRESS_POLL_S, left))
            if done.done():
                done.result()  # its error, if any, as a plain wait would raise it
                break
    finally:
        done.cancel()
        job.release()
    return Response(status_code=200)


@router.get(MODEL_INFO.path)
@router.get(MODEL_INFO.legacy_path or MODEL_INFO.path)
async def model_info(engine: EngineDep) -> Response:
    return _json(
        ModelInfo(
            model_path=engine.scheduler.model_path,
            tokenizer_path=engine.model_dir,
            weight_version=engine.scheduler.weight_version,
            adapter_versions=dict(engine.scheduler.adapter_versions),
            model_type=engine.hf_config.model_type,
            architectures=list(engine.hf_config.architectures or []),
        )
    )


@router.get(SERVER_INFO.path)
@router.get(SERVER_INFO.legacy_path or SERVER_INFO.path)
async def server_info(engine: EngineDep) -> Response:
    sched = engine.scheduler
    running, waiting, update_pending = sched.counts()
    runner = sched.runner
    return _json(
        ServerInfo(
            served_model_name=engine.served_model_name,
            model_path=sched.model_path,
            tokenizer_path=engine.model_dir,
            weight_version=sched.weight_version,
            context_length=engine.context_length,
            max_running_requests=engine.config.max_running_requests,
            device=engine.device,
            dtype=engine.dtype,
            version=f"areal-local-engine-{__version__}",
            tp_size=engine.config.emulate_tp_size,
            dp_size=engine.config.emulate_dp_size,
            enable_dp_attention=engine.config.emulate_dp_attention,
            internal_states=[
                InternalState(
                    running=running,
                    waiting=waiting,
                    paused=sched.paused is not None,
                    pause_mode=sched.paused,
                    update_pending=update_pending,
                    forward_calls=runner.forward_calls if runner else 0,
                    prefill_forward_calls=runner.prefill_forward_calls if runner else 0,
                    decode_steps=sched.decode_steps,
                    generated_tokens=sched.generated_tokens,
                    last_gen_throughput=sched.last_gen_throughput,
                ).model_dump()
            ],
        )
    )


@router.get("/v1/models")
async def list_models(engine: EngineDep) -> Response:
    name = engine.served_model_name
    return _json(
        ModelList(
            data=[
                ModelCard(
                    id=name,
                    created=engine.started_at,
                    root=name,
                    max_model_len=engine.context_length,
                )
            ]
        )
    )


@router.get("/metrics")
async def metrics(engine: EngineDep) -> Response:
    """A few SGLang-named gauges in Prometheus text format."""
    sched = engine.scheduler
    running, waiting, _ = sched.counts()
    label = f'{{model_name="{engine.served_model_name}"}}'
    lines = [
        "# TYPE sglang:num_running_reqs gauge",
        f"sglang:num_running_reqs{label} {running}",
        "# TYPE sglang:num_queue_reqs gauge",
        f"sglang:num_queue_reqs{label} {waiting}",
        "# TYPE sglang:gen_throughput gauge",
        f"sglang:gen_throughput{label} {sched.last_gen_throughput}",
        "# TYPE sglang:generation_tokens_total counter",
        f"sglang:generation_tokens_total{label} {sched.generated_tokens}",
    ]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def _error_body(message: str) -> dict[str, dict[str, str]]:
    return {"error": {"message": message}}


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


def create_engine_app(
    config: EngineConfig, model_dir: Path | str, cpu_share_file: Path | None = None
) -> FastAPI:
    """The engine app. The model loads in the scheduler thread when the app starts
    (lifespan); until then /health answers 503 and /generate requests queue.
    `cpu_share_file`: share the cores with a trainer on this host (`areal_service/cpu_share.py`)."""
    engine = Engine(config, model_dir, cpu_share_file)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.scheduler.stop)

    app = FastAPI(title="AReaL local engine (SGLang native API subset)", lifespan=lifespan)
    app.state.engine = engine
    app.include_router(router)

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return JSONResponse(_error_body(exc.message), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(_error_body(_validation_message(exc)), status_code=400)

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on (host, port); port 0 picks a free one."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    return sock


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_engine(config: ServiceConfig) -> None:
    """Serve `config.model_dir()` on engine.host:engine.port until interrupted (blocking).
    Builds the tiny model first when no `engine.model` is configured."""
    model_dir = config.model_dir()
    if config.engine.model is None:
        from engine.tiny_model import ensure_tiny_model

        ensure_tiny_model(model_dir)
    import torch

    threads = config.engine.torch_threads
    on_cpu = config.engine.device == "cpu" or (
        config.engine.device == "auto" and not torch.cuda.is_available()
    )
    if threads is None and on_cpu:
        # The engine shares the cores with the gateway (and the trainer): with all cores,
        # SmolLM2-135M on 2 cores decoded 15 tokens/s at 32 concurrent, with one, 78.
        threads = max(1, host_cores() // 2)
    if threads:
        torch.set_num_threads(threads)
    app = create_engine_app(
        config.engine, model_dir, config.cpu_share_file() if config.cpu_share else None
    )
    sock = bind_socket(config.engine.host, config.engine.port)
    logger.info("local engine serving %s at %s", model_dir, socket_url(sock))
    server = uvicorn.Server(
        uvicorn.Config(app, log_level=config.log_level, timeout_graceful_shutdown=5)
    )
    server.run(sockets=[sock])
