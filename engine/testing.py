"""Test helpers around the local engine: a real uvicorn server on loopback in a background
thread, and same-architecture weight variants for hot-swap tests.

Used by the engine's and the gateway's tests; never by production code. Stops exactly
the server it started (no process killing).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from areal_service.config import EngineConfig
from engine.server import bind_socket, create_engine_app, socket_url


@contextmanager
def start_engine_in_thread(
    model_dir: Path | str, *, ready_timeout_s: float = 120.0, **engine_overrides: Any
) -> Iterator[str]:
    """Serve `model_dir` on 127.0.0.1 (a free port unless `port=` is given) and yield the
    base URL once `/health` answers 200; the server and its scheduler stop on exit.
    `engine_overrides` are EngineConfig fields (device, dtype, max_running_requests, ...)."""
    config = EngineConfig(**{"host": "127.0.0.1", "port": 0, **engine_overrides})
    app = create_engine_app(config, model_dir)
    sock = bind_socket(config.host, config.port)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            timeout_graceful_shutdown=2,
            lifespan="on",
        )
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="engine-uvicorn", daemon=True
    )
    thread.start()
    base_url = socket_url(sock)
    try:
        _wait_healthy(base_url, thread, ready_timeout_s)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def _wait_healthy(base_url: str, thread: threading.Thread, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=base_url, timeout=5.0) as client:
        while time.monotonic() < deadline:
            if not thread.is_alive():
                raise RuntimeError(f"engine server at {base_url} exited during startup")
            try:
                if client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not accepting connections yet
            time.sleep(0.05)
    raise TimeoutError(f"engine at {base_url} not healthy after {timeout_s}s")


def make_weight_variant(model_dir: Path | str, out_dir: Path | str, seed: int) -> Path:
    """Save a checkpoint with the SAME architecture and tokenizer as `model_dir` but weights
    freshly initialised from `seed`: what a trainer publishes, for swap tests. (A tiny model
    built with another `TinyModelSpec.seed` trains another tokenizer and may differ in vocab
    size, which a disk update must reject.)"""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, out = Path(model_dir), Path(out_dir)
    config = AutoConfig.from_pretrained(src)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out
