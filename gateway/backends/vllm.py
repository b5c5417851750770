"""VLLMClient: the `Backend` of a vLLM server, a sibling of `SGLangClient` (routing,
capture, token continuity, interruptible generation and the weight swap use either
unchanged, through `gateway/backends/base.py`). It implements the wire hooks and the
control calls in vLLM's own terms; the routes and fields are typed in
`areal_service/vllm_protocol.py`.

- Generation: `POST /inference/v1/generate` (token in, token out): the request built by
  `vllm_protocol.request_from_sglang`, each reply or stream chunk read straight into the
  gateway's `TokenChunk` (`gateway/backends/records.py`), with no SGLang reply in
  between. Stream chunks carry only new tokens, so they reach
  `generate_interruptible_stream` as SGLang's incremental chunks do.
- Versions: vLLM reports `weight_versions` spans on a whole reply and on a stream's last
  chunk only. Chunks before it are tagged with the version this client last saw the
  server report or set (`weight_version`); the last chunk's span (the server's word) then
  confirms it. A swap pauses in mode abort, so one request never spans two versions.
  With several gateway processes, a follower's label can trail the leader's swap until
  the follower sees a reply or a health check (`model_info`) that reports the new one.
- Swap from disk: `POST /pause?mode=abort` → `POST /collective_rpc reload_weights` →
  `POST /update_weight_version` → `POST /resume` (resume always sent; see
  `Backend.swap_weights`).
- Aborts: vLLM keeps a request as `generate-tokens-<id>`, so aborts send that id.
- Named policies (`policies:`): versioned adapter names (`gateway/adapters.py`), loaded
  with `/v1/load_lora_adapter` (never in place) and dropped with
  `/v1/unload_lora_adapter` once drained; a request is sent with `model: <policy>@v<N>`,
  or without a model (the base) before the policy's first version. No pause, and the
  tokens' versions come from the name, not from the server's one label.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Unpack

from pydantic import BaseModel, ValidationError

from areal_service.lora_adapter import is_adapter_dir
from areal_service.sglang_protocol import (
    InitWeightsUpdateGroupRequest,
    ModelInfo,
    PauseMode,
    UpdateWeightsFromDistributedRequest,
    parse_version,
)
from areal_service.vllm_protocol import (
    ABORT_REQUESTS,
    COLLECTIVE_RPC,
    COMPLETIONS,
    GENERATE,
    HEALTH,
    LOAD_LORA_ADAPTER,
    MODELS,
    PAUSE,
    RESET_PREFIX_CACHE,
    RESUME,
    UNLOAD_LORA_ADAPTER,
    UPDATE_WEIGHT_VERSION,
    WEIGHT_INFO,
    Choice,
    LoadLoRAAdapterRequest,
    ModelList,
    PromptScoreRequest,
    PromptScoreResponse,
    UnloadLoRAAdapterRequest,
    VLLMGenerateResponse,
    WeightInfo,
    choice_logprobs,
    finish_reason_of,
    internal_request_id,
    request_from_sglang,
)
from gateway.adapters import AdapterNames
from gateway.backends.base import Backend
from gateway.backends.errors import BackendError
from gateway.backends.records import EngineReply, TokenChunk, TokenRequest
from gateway.backends.transport import ClientOptions
from gateway.stream_parse import ErrorEvent, parse_chunk


class VLLMClient(Backend):
    """Client of one vLLM server (`python -m vllm.entrypoints.openai.api_server` with
    `--enable-scale-out`, `VLLM_SERVER_DEV_MODE=1`; the launcher sets both)."""

    def __init__(
        self,
        base_url: str,
        *,
        lora_name: str | None = None,
        adapters: AdapterNames | None = None,
        **options: Unpack[ClientOptions],
    ) -> None:
        super().__init__(base_url, adapters=adapters, **options)
        self.weight_version = "default"
        """The server's weight label as last reported or set (vLLM starts at "default")."""
        self.lora_name = lora_name
        """With a LoRA policy (`default_policy.lora`): the adapter a request that names
        none runs under (the launcher starts the server with it, swaps replace it in
        place); None: the base model."""

    # -- wire hooks --------------------------------------------------------------------
    def _generate_body(self, payload: TokenRequest, *, stream: bool) -> tuple[str, bytes]:
        # A leased request (`Backend.generate`) sets `lora_path` explicitly, to its
        # versioned name or to None (the base model); an unset one takes the default.
        model = payload.lora_path if payload.lora_set else self.lora_name
        request = request_from_sglang(payload, stream=stream, model=model)
        return GENERATE.path, request.to_json_bytes()

    def _generate_reply(self, raw: bytes, payload: TokenRequest) -> TokenChunk:
        reply = VLLMGenerateResponse.model_validate_json(raw)
        if not reply.choices:
            raise self.http.failed("vLLM reply without choices", 502)
        choice = reply.choices[0]
        return self._chunk(choice, 0, len(choice.token_ids or ()), payload.top_logprobs_num)

    def _chunk(self, choice: Choice, before: int, count: int, top_k: int) -> TokenChunk:
        """One choice as the gateway's `TokenChunk`: its tokens (the new ones of a stream
        chunk), the version its spans report (else the last one seen), and its finish
        reason. `before`/`count`: output tokens before it and with it."""
        if choice.weight_versions:
            self._saw_version(choice.weight_versions[-1].version)
        logprobs, tops = choice_logprobs(choice, top_k)
        return TokenChunk(
            output_ids=tuple(choice.token_ids or ()),
            logprobs=logprobs,
            top_logprobs=tops,
            weight_version=self.weight_version,
            finish_reason=finish_reason_of(choice, count),
            cumulative=before == 0,
        )

    def _stream_parser(self, payload: TokenRequest, new_only: bool) -> _VLLMChunks:
        return _VLLMChunks(self, payload)

    def _saw_version(self, version: str | None) -> None:
        """Keep the newest version the server reported (a late reply of an older round
        must not move the label back)."""
        if version is not None and parse_version(version) >= parse_version(self.weight_version):
            self.weight_version = version

    # -- control -----------------------------------------------------------------------
    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        """`/pause?mode=abort` (SGLang's `retract` / `in_place` become vLLM's `keep`:
        requests freeze and continue after resume)."""
        vllm_mode = "abort" if mode == "abort" else "keep"
        await self.http.call(
            PAUSE, path=f"{PAUSE.path}?mode={vllm_mode}", timeout_s=self.http.control_timeout_s
        )

    async def continue_generation(self) -> None:
        await self.http.control(RESUME)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, *, lora_name: str | None = None
    ) -> str:
        """`reload_weights` from `model_path` (safetensors of the same architecture), then
        label them `weight_version`. The pause before it cleared the prefix cache.
        A checkpoint whose output head is tied to its embeddings but not stored as a
        tensor is refused (400): vLLM's in-place reload would keep the old head.
        A LoRA adapter directory (`default_policy.lora`) is loaded in place under the default
        adapter's name instead (`/v1/load_lora_adapter`, `load_inplace`; ~30 ms on CPU
        for SmolLM2). A named policy's adapter (`lora_name`) is swapped by
        `swap_adapter` (versioned names), never here."""
        if lora_name is not None:
            raise self.http.failed(
                f"policy {lora_name!r}: a vLLM backend swaps a policy's adapter under "
                "versioned names (swap_weights with versioned adapters), not in place"
            )
        await self._reload(model_path)
        if weight_version is not None:
            await self.http.control(UPDATE_WEIGHT_VERSION, _Json(new_version=weight_version))
            self.weight_version = weight_version
        return f"reloaded weights from {model_path}"

    async def _reload(self, model_path: str) -> None:
        """The load of `update_weights_from_disk`: the adapter in place, or the weights."""
        if is_adapter_dir(model_path):
            if self.lora_name is None:
                raise self.http.failed(
                    f"{model_path} is a LoRA adapter but this vLLM "
                    "backend serves full weights (set default_policy.lora so the "
                    "launcher starts it with --enable-lora)"
                )
            body = LoadLoRAAdapterRequest(
                lora_name=self.lora_name, lora_path=model_path, load_inplace=True
            )
            await self.http.call(LOAD_LORA_ADAPTER, body)
        elif tied_head_missing(Path(model_path)):
            raise self.http.failed(
                f"{model_path} ties its output head to the embeddings "
                "and stores no lm_head.weight; vLLM's in-place reload would "
                "keep serving the old head. Publish it with the trainer (it "
                "writes tied-head.safetensors for vLLM backends)"
            )
        else:
            reload = _Json(method="reload_weights", kwargs={"weights_path": model_path})
            await self.http.call(COLLECTIVE_RPC, reload)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """`/v1/load_lora_adapter` under a new name (400 "already been loaded" for a name
        it holds)."""
        await self.http.call(
            LOAD_LORA_ADAPTER, LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
        )

    async def unload_lora_adapter(self, name: str) -> None:
        """`/v1/unload_lora_adapter` (404 for a name it does not hold); requests already
        running under it finish under it."""
        await self.http.control(UNLOAD_LORA_ADAPTER, UnloadLoRAAdapterRequest(lora_name=name))

    async def abort_request(self, rid: str = "", *, abort_all: bool = False) -> None:
        """Abort one request by the id it was sent with, or every one (`abort_all`)."""
        body = _Json() if abort_all else _Json(request_ids=[internal_request_id(rid)])
        await self.http.control(ABORT_REQUESTS, body)

    async def flush_cache(self) -> None:
        await self.http.control(RESET_PREFIX_CACHE)

    async def score_tokens(
        self, ids: Sequence[int], start: int, *, lora_name: str | None = None
    ) -> list[float]:
        """`/v1/completions` with `prompt_logprobs` (vLLM's token-in route does not
        return prompt logprobs); `lora_name` None scores the default adapter if any."""
        return (await self.score_canary([(ids, start)], lora_name=lora_name))[0]

    async def score_canary(
        self, sequences: Sequence[tuple[Sequence[int], int]], *, lora_name: str | None = None
    ) -> list[list[float]]:
        """Every sequence in ONE `/v1/completions` request (a list of prompts): one
        round trip, and vLLM schedules them together. The cost is their prefill with
        the output head at every position (`prompt_logprobs`), ~25% more than a plain
        prefill on the CPU; a single request per prompt measured slower and less steady
        (benchmarks/swap_verify_cost.py)."""
        model = lora_name or self.lora_name
        prompts = [list(ids) for ids, _ in sequences]
        body = PromptScoreRequest(  # every field set: the call sends only those
            prompt=prompts[0] if len(prompts) == 1 else prompts,
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=0,
            **({} if model is None else {"model": model}),
        )
        raw = await self.http.call(COMPLETIONS, body)
        try:
            reply = PromptScoreResponse.model_validate_json(raw)
        except ValidationError as e:
            raise self.http.malformed(COMPLETIONS.path, e) from e
        return [
            reply.scored(ids, start, i)
            for i, (ids, (_, start)) in enumerate(zip(prompts, sequences, strict=True))
        ]

    async def health(self, timeout_s: float = 10.0) -> bool:
        """True on 200 from `/health`; False on errors and timeouts."""
        return await self.http.healthy(HEALTH, timeout_s)

    async def model_info(self) -> ModelInfo:
        """`/v1/models` (the checkpoint) and `/weight_info` (its label) as the gateway's
        `ModelInfo`."""
        try:
            models = ModelList.model_validate_json(await self.http.control(MODELS))
            info = WeightInfo.model_validate_json(await self.http.control(WEIGHT_INFO))
        except ValidationError as e:
            raise self.http.malformed(WEIGHT_INFO.path, e) from e
        self._saw_version(info.weight_version)
        card = models.data[0] if models.data else None
        return ModelInfo(
            model_path=(card.root or card.id) if card else "", weight_version=info.weight_version
        )

    async def server_info(self) -> dict[str, Any]:
        """For display: the served models and the weight label (vLLM has no
        `/server_info`)."""
        models = json.loads(await self.http.control(MODELS))
        info = json.loads(await self.http.control(WEIGHT_INFO))
        return {"engine": "vllm", "models": models.get("data", []), **info}

    async def init_weights_update_group(self, body: InitWeightsUpdateGroupRequest) -> str:
        raise self._no_distributed()

    async def update_weights_from_distributed(
        self, body: UpdateWeightsFromDistributedRequest
    ) -> str:
        raise self._no_distributed()

    async def destroy_weights_update_group(self, group_name: str) -> str:
        raise self._no_distributed()

    async def begin_weight_update(self) -> None:
        raise self._no_distributed()

    async def end_weight_update(self) -> None:
        raise self._no_distributed()

    def _no_distributed(self) -> BackendError:
        return self.http.failed(
            "a vLLM backend takes new weights from disk "
            "(trainer.weight_sync: disk); vLLM's own weight-transfer protocol "
            "is not wired to the trainer's broadcast yet",
            501,
        )


def tied_head_missing(model_dir: Path) -> bool:
    """Whether `model_dir` (an HF checkpoint) ties `lm_head` to the embeddings and holds no
    `lm_head.weight` tensor in the safetensors files vLLM reads (those its index names, or
    all). Reads `config.json` and the files' JSON headers only. False when it cannot tell
    (no config: the reload reports its own error)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if not config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)):
        return False
    index = model_dir / "model.safetensors.index.json"
    try:
        files = (
            {model_dir / f for f in json.loads(index.read_text())["weight_map"].values()}
            if index.exists()
            else set(model_dir.glob("*.safetensors"))
        )
        return not any("lm_head.weight" in _safetensors_keys(f) for f in files)
    except (OSError, ValueError, KeyError):
        return False


def _safetensors_keys(path: Path) -> set[str]:
    """Tensor names in a safetensors file's header (8-byte little-endian length, JSON)."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return set(json.loads(f.read(size))) - {"__metadata__"}


class _Json(BaseModel):
    """A small control body, sent as given."""

    model_config = {"extra": "allow"}


class _VLLMChunks:
    """Parses one vLLM stream's payloads into `TokenChunk`s of their new tokens."""

    def __init__(self, client: VLLMClient, payload: TokenRequest) -> None:
        self.client = client
        self.top_logprobs_num = payload.top_logprobs_num
        self.count = 0
        """Output tokens so far (each chunk holds only its new ones)."""

    def chunks(self, batch: list[bytes], coalesce: bool) -> list[EngineReply | ErrorEvent | None]:
        out: list[EngineReply | ErrorEvent | None] = []
        for data in batch:
            if data == b"[DONE]":
                out.append(None)
                break
            if b'"error":' in data and isinstance(event := parse_chunk(data), ErrorEvent):
                out.append(event)
                continue
            reply = VLLMGenerateResponse.model_validate_json(data)
            for choice in reply.choices[:1]:  # the usage chunk has none
                before = self.count
                self.count += len(choice.token_ids or ())
                out.append(self.client._chunk(choice, before, self.count, self.top_logprobs_num))
        return out
